"""The manifest file of a run dir: written atomically, read back with one-line errors.

What goes into a manifest is replay's business (`agentab.replay.manifest`); how it is stored is
the run dir's, so the analysis reading it and the replay writing it agree on one file without
importing each other. The write is atomic because the manifest is rewritten at the end of a run
with its outcome, and a run killed during that rewrite must still leave the first version whole.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from agentab.errors import AgentabError
from agentab.rundir.schema import MANIFEST


def is_run_dir(path: Path) -> bool:
    """A run dir is a directory holding manifest.json (records may still be empty)."""
    return (path / MANIFEST).is_file()


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    """Replace `run_dir/manifest.json` as a whole (temporary name, then rename)."""
    path = run_dir / MANIFEST
    tmp = run_dir / f".tmp-{MANIFEST}"
    tmp.write_bytes(
        orjson.dumps(
            manifest,
            option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS,
            default=str,
        )
    )
    os.replace(tmp, path)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Parse `path/manifest.json`; a missing or malformed file is a one-line user error."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        raise AgentabError(f"{path}: not a run dir (no {MANIFEST})")
    try:
        manifest = orjson.loads(file.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise AgentabError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise AgentabError(f"{file}: expected a JSON object at the top level")
    return manifest
