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
    "agentab/analysis/",
    "agentab/replay/",
    "agentab/workloads/",
    "agentab/engine/profiles/gb300-tp16-kimi-k3.toml",
    "agentab/cli.py",
    "benchmarks/bench_",
    "tests/",
)
FORBIDDEN = re.compile(
    r"REFERENCE\.md|\.\./shared|seed-summary|helper-rules|for the lead|\bthe lead\b"
    r"|\bissue \d+|\(issue|\bsession \d+\b|seed article",
    re.IGNORECASE,
)


def tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [f for f in out if f.startswith(SCOPE) and (REPO / f).is_file()]


def test_no_citation_of_what_is_not_in_the_repository() -> None:
    this = Path(__file__).relative_to(REPO).as_posix()
    hits = []
    for name in tracked_files():
        if name == this:
            continue
        try:
            text = (REPO / name).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{name}:{lineno}: {line.strip()[:80]}")
    assert hits == []


def test_architecture_page_exists_and_its_links_resolve() -> None:
    text = (REPO / "ARCHITECTURE.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links and all((REPO / link).is_file() for link in links), links
