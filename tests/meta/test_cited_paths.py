"""Every repository path that a Markdown page cites exists in the tree.

The measurement history (benchmarks/NOTES.md, benchmarks/kernels/NOTES.md), the docs and the
result folders' READMEs cite scripts, modules and result files by path; a rename or a move that
misses one leaves a reader following a path to nothing. A file that history has to name although
it is gone is cited with the words "(no longer in the tree)" right after it, which this test
accepts.

The pages under benchmarks/ also name files without their folder: a result folder's README its
own files (`timing.json`, `../kernels-h200.json`), the notes a module by its tail
(`cute/moe.py`). Those names are checked too, resolved the way a reader resolves them.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = "benchmarks/results"
# Not inside a URL or a longer path; then the path's own characters (globs `*` and brace
# alternatives `{md,json}` allowed), ending before trailing punctuation; then the optional mark.
START = r"(?<![\w./-])((?:"
TAIL = r")/[\w.*{},/-]*[\w*}/])"
MARK = r"(`?\s*\(no longer in the tree\))?"
# A file name in backticks without a top-level folder: optional `../` steps, the name's own
# characters (globs and brace alternatives allowed) and an extension of the files results keep.
EXTENSIONS = "json|log|md|toml|txt|csv|jsonl|html|py|sh"
BARE = re.compile(
    r"`((?:\.\./)*[\w*{][\w.*{},/-]*\.(?:\{[\w.,]+\}|(?:" + EXTENSIONS + r")))`" + MARK
)
ROOTS = ["agentab", "benchmarks", "docs", "examples", "scripts", "tests"]


def tracked_files() -> list[str]:
    return subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()


def citation_pattern(roots: list[str]) -> re.Pattern[str]:
    return re.compile(START + "|".join(map(re.escape, roots)) + TAIL + MARK)


def expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", path)
    if match is None:
        return [path]
    return [
        expanded
        for alternative in match[1].split(",")
        for expanded in expand_braces(path[: match.start()] + alternative + path[match.end() :])
    ]


def cited_paths(text: str, results_folders: list[str]) -> list[tuple[int, str]]:
    """(line, path) for every path cited in `text`, except those marked as no longer present.

    Paths start at a top-level folder; the measurement notes also cite result files from their
    result folder's name on (`kernels-h200-x/file.json`), which resolve under benchmarks/results.
    """
    from_root = citation_pattern(ROOTS)
    from_results = citation_pattern(results_folders) if results_folders else None
    cited = []
    for number, line in enumerate(text.splitlines(), 1):
        cited += [(number, m[1]) for m in from_root.finditer(line) if m[2] is None]
        if from_results is not None:
            cited += [
                (number, f"{RESULTS}/{m[1]}") for m in from_results.finditer(line) if m[2] is None
            ]
    return cited


def exists(path: str, files: list[str], folders: set[str]) -> bool:
    names = set(files)
    for candidate in expand_braces(path.rstrip("/")):
        if "*" in candidate:
            if not any(
                fnmatch.fnmatch(f, candidate) or fnmatch.fnmatch(f, candidate + "/*") for f in files
            ):
                return False
        elif candidate not in names and candidate not in folders:
            return False
    return True


def bare_names(text: str, results_folders: list[str]) -> list[tuple[int, str]]:
    """(line, name) for every file named in backticks without a folder `cited_paths` resolves."""
    skip = tuple(f"{top}/" for top in ROOTS + results_folders)
    return [
        (number, m[1])
        for number, line in enumerate(text.splitlines(), 1)
        for m in BARE.finditer(line)
        if m[2] is None and not m[1].startswith(skip)
    ]


def bare_name_exists(name: str, page: str, files: list[str]) -> bool:
    """In a result folder a name is relative to the page (its files sit beside it); elsewhere
    under benchmarks/ it is the tail of a tracked path (`cute/moe.py`)."""
    for candidate in expand_braces(name):
        if page.startswith(RESULTS + "/"):
            path = posixpath.normpath(posixpath.join(posixpath.dirname(page), candidate))
            found = any(fnmatch.fnmatch(f, path) for f in files)
        else:
            found = any(fnmatch.fnmatch(f, f"*/{candidate}") or f == candidate for f in files)
        if not found:
            return False
    return True


def test_cited_paths_finds_paths_globs_and_marked_absences() -> None:
    text = (
        "Raw output: `benchmarks/results/x/` (see docs/replay.md, and\n"
        "benchmarks/results/a-*.{md,json}). https://example.org/docs/page.md is a URL;\n"
        "`scripts/gpu/old.py` (no longer in the tree) moved to scripts/gpu/new.py.\n"
        "a result folder's file (`kernels-a/run.json`), a word ending in x/ no\n"
    )
    assert cited_paths(text, ["x", "kernels-a"]) == [
        (1, "benchmarks/results/x/"),
        (1, "docs/replay.md"),
        (2, "benchmarks/results/a-*.{md,json}"),
        (3, "scripts/gpu/new.py"),
        (4, "benchmarks/results/kernels-a/run.json"),
    ]


def test_exists_expands_globs_braces_and_folders() -> None:
    files = ["benchmarks/results/a-1.md", "benchmarks/results/a-1.json", "docs/replay.md"]
    folders = {"benchmarks", "benchmarks/results", "docs"}
    assert exists("benchmarks/results/a-*.{md,json}", files, folders)
    assert exists("benchmarks/results/", files, folders)
    assert not exists("benchmarks/results/a-*.{md,log}", files, folders)
    assert not exists("docs/missing.md", files, folders)


def test_bare_names_resolve_beside_a_result_page_and_by_tail_elsewhere() -> None:
    text = (
        "`timing.{json,log}`, `../kernels.json` and `kernels-a/run.json`;\n"
        "`gone.py` (no longer in the tree), `cute/moe.py`, `auto` and `docs/x.md`\n"
    )
    assert bare_names(text, ["kernels-a"]) == [
        (1, "timing.{json,log}"),
        (1, "../kernels.json"),
        (2, "cute/moe.py"),
    ]
    files = [
        "benchmarks/results/x/timing.json",
        "benchmarks/results/x/timing.log",
        "benchmarks/results/kernels.json",
        "agentab/kernels/cute/moe.py",
    ]
    page = "benchmarks/results/x/README.md"
    assert bare_name_exists("timing.{json,log}", page, files)
    assert bare_name_exists("../kernels.json", page, files)
    assert not bare_name_exists("kernels.json", page, files)
    assert bare_name_exists("cute/moe.py", "benchmarks/kernels/NOTES.md", files)
    assert not bare_name_exists("moe.py", page, files)
    assert not bare_name_exists("explore.py", "benchmarks/kernels/NOTES.md", files)


PAGES = sorted(p for p in tracked_files() if p.endswith(".md"))


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_path_exists(page: str) -> None:
    files = tracked_files()
    folders = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    results_folders = sorted({f.split("/")[2] for f in files if f.startswith(RESULTS + "/")})
    missing = [
        f"{page}:{line}: {path}"
        for line, path in cited_paths((REPO / page).read_text(), results_folders)
        if not exists(path, files, folders)
    ]
    assert missing == []


@pytest.mark.parametrize("page", [p for p in PAGES if p.startswith("benchmarks/")])
def test_every_file_named_under_benchmarks_exists(page: str) -> None:
    files = tracked_files()
    results_folders = sorted({f.split("/")[2] for f in files if f.startswith(RESULTS + "/")})
    missing = [
        f"{page}:{line}: {name}"
        for line, name in bare_names((REPO / page).read_text(), results_folders)
        if not bare_name_exists(name, page, files)
    ]
    assert missing == []
