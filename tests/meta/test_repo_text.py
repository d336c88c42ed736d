"""The docs and the code speak of the product: no citations of files outside the repository,
of issue numbers, or of how the code came to be written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCOPE = (
    "README.md",
    "ARCHITECTURE.md",
    ".ci/",
    "docs/",
    "examples/",
    "agentab/",
    "scripts/",
    "benchmarks/bench_",
    "benchmarks/NOTES.md",
    "benchmarks/kernels/NOTES.md",
    "benchmarks/results/",
    "tests/",
)
# how the code came to be written: numbered issues and sessions
HISTORY = re.compile(r"\bissue \d+|\(issue(?!-)|\bsession \d+\b", re.IGNORECASE)
# a path that climbs out of the repository, or a note named like this repo's own top-level
# pages (UPPERCASE.md) that the repository does not hold
RELATIVE_PATH = re.compile(r"(?:\.\./)+[\w.-]+")
NOTE_NAME = re.compile(r"\b[A-Z][A-Z0-9_-]*\.md\b")


def repo_files() -> list[str]:
    return subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


def tracked_files() -> list[str]:
    return [f for f in repo_files() if f.startswith(SCOPE) and (REPO / f).is_file()]


def cites_outside(line: str, where: Path, names: set[str]) -> bool:
    """Whether `line` of the file in `where` points at something outside the repository."""
    for path in RELATIVE_PATH.findall(line):
        if not (where / path).resolve().is_relative_to(REPO):
            return True
    return any(note not in names for note in NOTE_NAME.findall(line))


def test_no_citation_of_what_is_not_in_the_repository() -> None:
    this = Path(__file__).relative_to(REPO).as_posix()
    names = {Path(f).name for f in repo_files()}
    hits = []
    for name in tracked_files():
        if name == this:
            continue
        try:
            text = (REPO / name).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        where = (REPO / name).parent
        for lineno, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line) or cites_outside(line, where, names):
                hits.append(f"{name}:{lineno}: {line.strip()[:80]}")
    assert hits == []


def test_architecture_page_exists_and_its_links_resolve() -> None:
    text = (REPO / "ARCHITECTURE.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links and all((REPO / link).is_file() for link in links), links
