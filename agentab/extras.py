"""Optional dependencies (pyproject's extras): checked before the work starts, with the command
that installs them for this install.

Why the command depends on the install: agentab runs from a clone (an editable install, or the
source tree on the path) as often as from a package index, and `pip install 'agentab[torch]'`
asks an index for a package a clone's user may not find there; from a clone the working command
is `pip install -e '.[torch]'`. The check itself asks only whether the module can be found, so it
costs nothing where the module is installed and never imports it.
"""

from __future__ import annotations

import importlib.util
import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlsplit

from agentab.errors import AgentabError

PACKAGE_DIR = Path(__file__).resolve().parent

EXTRA_OF: dict[str, str] = {
    "torch": "torch",
    "safetensors": "torch",
    "plotly": "report",
    "triton": "gpu",
    "cutlass": "gpu",
    "ray": "ray",
}
"""The extra of pyproject.toml that installs each optional module."""


def _quoted(spec: str) -> str:
    return f"'{spec}'"


def install_command(
    extra: str,
    *,
    package_dir: Path = PACKAGE_DIR,
    cwd: Path | None = None,
    direct_url: str | None = None,
) -> str:
    """The pip command that adds `extra` to this install.

    A source tree (pyproject.toml beside the package): `pip install -e '.[extra]'` from its
    root, its path from anywhere else. An install from a local folder (PEP 610's
    direct_url.json names a file: URL): that folder. Otherwise an index: `agentab[extra]`.
    """
    root = package_dir.parent
    if (root / "pyproject.toml").is_file():
        here = Path.cwd() if cwd is None else cwd
        where = "." if here.resolve() == root.resolve() else str(root)
        return f"pip install -e {_quoted(f'{where}[{extra}]')}"
    source = _direct_url() if direct_url is None else direct_url
    if source:
        try:
            info = json.loads(source)
        except ValueError:
            info = {}
        url = info.get("url", "") if isinstance(info, dict) else ""
        if url.startswith("file:"):
            folder = unquote(urlsplit(url).path)
            editable = bool((info.get("dir_info") or {}).get("editable"))
            flag = "-e " if editable else ""
            return f"pip install {flag}{_quoted(f'{folder}[{extra}]')}"
    return f"pip install {_quoted(f'agentab[{extra}]')}"


def _direct_url() -> str | None:
    try:
        return metadata.distribution("agentab").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None


def missing(module: str) -> bool:
    """Whether `module` cannot be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def require(module: str, needed_by: str, extra: str | None = None) -> None:
    """Refuse, before any work, what needs an optional module that is not installed."""
    if missing(module):
        raise AgentabError(missing_message(module, needed_by, extra))


def missing_message(module: str, needed_by: str, extra: str | None = None) -> str:
    """One line: what needs the module, and the command that installs its extra (by default
    the one `EXTRA_OF` names)."""
    extra = extra or EXTRA_OF.get(module.split(".")[0])
    hint = f"install it with: {install_command(extra)}" if extra else "install it"
    return f"{needed_by} needs {module}, which is not installed here; {hint}"
