"""Every malformed input: one line on stderr naming the file and line or session and request,
exit status 2, no traceback (the corpus lives in tests/data/bad/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agentab.errors import AgentabError
from agentab.workloads import load

from .conftest import DATA, run_main

BAD = DATA / "bad"

# file -> what the one-line message must say after "<file>"
EXPECTED = {
    "bad_scope.json": (
        ": session 's1': field 'hash_id_scope' must be 'local' or 'global', got 'shared'"
    ),
    "block_size_zero.json": ": session 's1': field 'block_size' must be >= 1 (got 0)",
    "empty.json": ": file is empty",
    "garbage.json": ":1: not a JSON object",
    "hash_id_not_int.json": (
        ": session 's1': request 0: field 'hash_ids' must hold integers >= 0, found '2'"
    ),
    "hash_ids_exceed_in.json": (
        ": session 's1': request 0: 'hash_ids' has 3 blocks of 64 tokens but 'in' is 100 "
        "(at most 2 blocks, a partial last one included)"
    ),
    "in_is_string.json": ": session 's1': request 0: field 'in' must be an integer, got string",
    "invalid_line.jsonl": ":2: invalid JSON (",
    "missing_in.json": ": session 's1': request 0: missing field 'in'",
    "mooncake_hash_ids_exceed.jsonl": (
        ":1: 'hash_ids' has 3 blocks of 512 tokens (1536) but 'input_length' is 600"
    ),
    "mooncake_negative_input.jsonl": ":2: field 'input_length' is negative (-1)",
    "native_truncated.jsonl": ": header says 2 sessions but the file has 1 (truncated?)",
    "negative_out.json": ": session 's1': request 0: field 'out' is negative (-5)",
    "nested_negative_in.json": ": session 's1': request 1.0: field 'in' is negative (-1)",
    "no_requests.json": ": session 's1': session has no requests",
    "non_monotonic_t.json": ": session 's1': request 1: 't' goes backwards (3 after 5)",
    "not_gzip.json.gz": ": not a valid gzip file (",
    "only_whitespace.jsonl": ": file is empty",
    "session_is_array.jsonl": ":1: not a JSON object",
    "subagent_without_requests.json": ": session 's1': request 1: missing field 'requests'",
    "out_too_large.json": (
        ": session 's1': request 0: field 'out' is out of range (9223372036854775808 > 10,000,000)"
    ),
    "in_float_too_large.json": (
        ": session 's1': request 0: field 'in' is out of range (1e+23 > 10,000,000)"
    ),
    "subagents_too_deep.json": (
        ": session 's1': request " + ".".join(["1"] + ["1"] * 32) + ": subagents nested more "
        "than 32 levels deep"
    ),
    "t_is_string.json": ": session 's1': request 0: field 't' must be a number, got string",
    "third_line_negative.jsonl": ":3: session 'c': request 0: field 'in' is negative (-3)",
    "truncated.json": ":1: invalid JSON (unexpected end of data, column 53)",
    "truncated_gzip.json.gz": ": not a valid gzip file (",
    "unknown_format.jsonl": ":1: cannot tell the trace format from the keys (max_tokens, prompt)",
    "unknown_type.json": (
        ": session 's1': request 0: unknown request type 'x' (expected 'n', 's' or 'subagent')"
    ),
}


def test_corpus_is_complete() -> None:
    files = sorted(p.name for p in BAD.iterdir())
    assert files == sorted(EXPECTED)
    assert len(files) >= 15


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_rejected_with_one_line(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = BAD / name
    assert run_main("workload", "inspect", str(path), "--json") == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"agentab: error: {path}{EXPECTED[name]}"), lines[0]


@pytest.mark.parametrize("name", ["truncated.json", "garbage.json", "nested_negative_in.json"])
def test_forced_format_still_one_line(name: str) -> None:
    with pytest.raises(AgentabError) as exc:
        load(BAD / name, "agentx")
    assert "\n" not in str(exc.value)
    assert str(exc.value).startswith(str(BAD / name))


def test_console_script_prints_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentab", "workload", "inspect", str(BAD / "negative_out.json")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr == (
        f"agentab: error: {BAD / 'negative_out.json'}: session 's1': request 0: "
        "field 'out' is negative (-5)\n"
    )


def test_missing_path_and_bad_format_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_main("workload", "inspect", str(tmp_path / "nope.jsonl")) == 2
    assert (
        capsys.readouterr().err
        == f"agentab: error: {tmp_path / 'nope.jsonl'}: no such file or directory\n"
    )
    with pytest.raises(AgentabError, match="unknown workload format 'csv'"):
        load(BAD / "empty.json", "csv")


def test_a_gzip_bomb_stops_at_the_size_limit(tmp_path: Path) -> None:
    # 64 MiB of zeros in a 64 KiB file; the limit is lowered to 1 MiB for the test.
    import gzip
    import os

    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        for _ in range(64):
            f.write(bytes(2**20))
    env = {**os.environ, "AGENTAB_MAX_WORKLOAD_BYTES": str(2**20)}
    result = subprocess.run(
        [sys.executable, "-m", "agentab", "workload", "inspect", str(bomb)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert (result.returncode, result.stderr) == (
        2,
        f"agentab: error: {bomb}: decompresses to more than 1,048,576 bytes, the most a trace "
        "may hold (set AGENTAB_MAX_WORKLOAD_BYTES to raise it)\n",
    )
    plain = tmp_path / "big.jsonl"
    plain.write_bytes(b" " * (2**20 + 1))
    result = subprocess.run(
        [sys.executable, "-m", "agentab", "workload", "inspect", str(plain)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    assert result.stderr == (
        f"agentab: error: {plain}: 1,048,577 bytes is more than the 1,048,576 a trace may hold "
        "(set AGENTAB_MAX_WORKLOAD_BYTES to raise it)\n"
    )
