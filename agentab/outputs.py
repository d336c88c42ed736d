"""Output paths of every command: made ready before the command starts its work.

One rule for every option that names something a command writes (`-o/--out`, `--output`,
`--html`, `--profile-out`): missing parent folders are created when the command line is read,
and a path that cannot be written (a file where a folder must be, a folder where a file must
be, a folder without write permission) is refused then, in one line naming the flag. Why at
parse time: `calibrate` measures for half a minute and `ab` for an hour before they write, and a
typo in a folder name must not cost that measurement.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import click

RULE = "Missing parent folders are created before the work starts."
"""The sentence every output option's --help ends with."""

Kind = Literal["file", "dir", "any"]
"""What a path names: a file, a folder, or either (a trace written as a file or a folder)."""


def prepare_output(path: Path, kind: Kind) -> None:
    """Create `path`'s missing parent folders; raise ValueError (one line) if it cannot be
    written as a `kind`."""
    if path.exists():
        if kind == "file" and path.is_dir():
            raise ValueError(f"{path} is a folder; expected a file name")
        if kind == "dir" and not path.is_dir():
            raise ValueError(f"{path} is a file; expected a folder")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{path} is not writable")
        return
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"cannot create folder {parent}: a file is in the way") from None
    except OSError as exc:
        raise ValueError(f"cannot create folder {parent}: {exc.strerror or exc}") from None
    if not parent.is_dir():
        raise ValueError(f"cannot create folder {parent}: a file is in the way")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"folder {parent} is not writable")


class OutputPath(click.ParamType):
    """A click type for what a command writes: `prepare_output` runs when the value is read."""

    name = "path"

    def __init__(self, kind: Kind = "file") -> None:
        self.kind = kind

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        path = value if isinstance(value, Path) else Path(str(value))
        try:
            prepare_output(path, self.kind)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return path


def output_help(text: str) -> str:
    """An output option's help: its own text, then the rule every output path follows."""
    return f"{text.rstrip()} {RULE}" if text else RULE
