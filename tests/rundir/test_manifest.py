"""The manifest file: written whole, read back with one-line errors naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentab.errors import AgentabError
from agentab.rundir import is_run_dir, read_manifest, write_manifest


def test_a_manifest_round_trips_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    assert not is_run_dir(tmp_path)
    write_manifest(tmp_path, {"arm": "auto", "stats": {"finished": 3}})
    write_manifest(tmp_path, {"arm": "auto", "status": "completed"})
    assert read_manifest(tmp_path) == {"arm": "auto", "status": "completed"}
    assert is_run_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "{dir}: not a run dir (no manifest.json)"),
        (b"{not json", "{dir}/manifest.json: not valid JSON ("),
        (b"[1, 2]", "{dir}/manifest.json: expected a JSON object at the top level"),
    ],
)
def test_a_bad_manifest_is_one_line_naming_the_file(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    if content is not None:
        (tmp_path / "manifest.json").write_bytes(content)
    with pytest.raises(AgentabError) as error:
        read_manifest(tmp_path)
    assert str(error.value).startswith(message.format(dir=tmp_path))
    assert "\n" not in str(error.value)
