"""Every measured figure that README.md and docs/*.md quote is held by a committed result file.

A figure typed into a page by hand goes stale when the code or the runs change, and nothing
notices; a figure some file under benchmarks/results/ holds can be traced to the run that made
it. Three forms are recognised, the ones a reader takes as measurements:

- a point estimate with its interval: `1.223 (1.067-1.412)`, `1.323 (95% CI 1.318-1.327)`,
  `0.874, 95% CI 0.803-0.930`, a report's table row `| 1.243 | 1.087 – 1.443 |` (the estimate
  inside its bounds, so version ranges do not count);
  all three numbers must be held by one JSON object or one line of one result file;
- a lone ratio after "B/A": `B/A 1.078`, `B/A of P90 interactivity 1.323`; held as an A/B ratio (a
  JSON value under one of RATIO_KEYS, or a number on a text line that says "B/A");
- a detectable change: `could detect +-10.7%`, held as `detectable_change` (a fraction) or as a
  written `+-10.7%`.

A number is held when it rounds to the figure at the figure's own precision (`1.08` is held by
1.0781). A made-up lone ratio of three decimals, or a made-up detectable change, still finds a
holder about one time in five (hundreds of them are on file); a made-up interval almost never
does. Figures that are inputs rather than measurements (a published figure quoted as such) go
in ALLOWED with the reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
TEXT_SUFFIXES = {".md", ".log", ".txt", ".toml", ".csv"}
NUM = r"\d+\.\d+"
DASH = r"\s*[-–]\s*"
INTERVALS = [
    re.compile(rf"(?<![\w.])({NUM}),?\s+\((?:95%\s+CI\s+)?({NUM}){DASH}({NUM})(?!\.?\d)\)?"),
    re.compile(rf"(?<![\w.])({NUM}),?\s+95%\s+CI\s+\(?({NUM}){DASH}({NUM})(?!\.?\d)"),
    # a report's table row copied into a page: `| 1.243 | 1.087 – 1.443 |` (B/A, then its CI)
    re.compile(rf"(?<=\|)\s*({NUM})\s*\|\s*({NUM}){DASH}({NUM})\s*(?=\|)"),
]
RATIO = re.compile(rf"B/A\s+(?:of\s+[\w ]{{1,40}}?\s+)?({NUM})(?!\.?\d)")
DETECT = re.compile(r"could\s+detect\s+(?:a\s+change\s+of\s+)?(?:\+-|±|\+/-)(\d+(?:\.\d+)?)%")
TEXT_NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+(?!\.?\d)")
WRITTEN_DETECT = re.compile(r"(?:\+-|±|\+/-)(\d+(?:\.\d+)?)%")

# the keys of comparison.json, sweep.json and fidelity.json that hold an A/B ratio (not a
# repeat's own ratio: a page quotes those as a list, and there are too many of them to tell)
RATIO_KEYS = {"ratio", "measured_ratio", "predicted_ratio", "median_ratio"}

# figure as quoted -> why it is not a measurement of ours
ALLOWED: dict[str, str] = {}


@dataclass
class Held:
    """The numbers one result file holds, sorted by how a figure may match them."""

    groups: list[set[float]] = field(default_factory=list)  # a JSON object's numbers, a line's
    ratios: set[float] = field(default_factory=set)
    detectable_pct: set[float] = field(default_factory=set)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _walk(value: object, key: str, held: Held) -> None:
    if isinstance(value, dict):
        held.groups.append({float(v) for v in value.values() if _is_number(v)})
        for k, v in value.items():
            _walk(v, str(k), held)
    elif isinstance(value, list):
        held.groups.append({float(v) for v in value if _is_number(v)})
        for v in value:
            _walk(v, key, held)
    elif _is_number(value):
        assert isinstance(value, int | float)
        if key in RATIO_KEYS:
            held.ratios.add(float(value))
        if "detectable" in key:
            held.detectable_pct.add(100 * float(value))


def held_by(path: Path) -> Held:
    held = Held()
    text = path.read_text(errors="replace")
    if path.suffix == ".json":
        try:
            _walk(json.loads(text), "", held)
        except json.JSONDecodeError:
            pass
        else:
            return held
    for line in text.splitlines():
        numbers = {float(n) for n in TEXT_NUMBER.findall(line)}
        held.groups.append(numbers)
        if "B/A" in line:
            held.ratios |= numbers
        held.detectable_pct |= {float(n) for n in WRITTEN_DETECT.findall(line)}
    return held


def result_files(root: Path = RESULTS) -> dict[str, Held]:
    return {
        str(p.relative_to(root)): held_by(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and (p.suffix == ".json" or p.suffix in TEXT_SUFFIXES)
    }


def rounds_to(value: float, figure: str) -> bool:
    """Whether `value` written at `figure`'s precision reads as `figure`."""
    places = len(figure.partition(".")[2])
    step = Decimal(1).scaleb(-places)
    return abs(Decimal(repr(value)) - Decimal(figure)) <= step / 2


@dataclass(frozen=True)
class Figure:
    """One quoted figure: where it stands, how it reads, and the numbers it consists of."""

    where: str
    quoted: str
    kind: str  # interval | ratio | detect
    numbers: tuple[str, ...]


def figures_in(page: Path, name: str) -> Iterator[Figure]:
    text = page.read_text()
    flat = text.replace("\n", " ")  # a figure may wrap; offsets stay those of `text`

    def where(offset: int) -> str:
        return f"{name}:{text.count(chr(10), 0, offset) + 1}"

    found: list[tuple[int, Figure]] = []
    for pattern in INTERVALS:
        for m in pattern.finditer(flat):
            r, lo, hi = m.groups()
            if Decimal(lo) <= Decimal(r) <= Decimal(hi):
                found.append((m.start(), Figure(where(m.start()), m[0], "interval", (r, lo, hi))))
    for kind, pattern in (("ratio", RATIO), ("detect", DETECT)):
        for m in pattern.finditer(flat):
            found.append((m.start(), Figure(where(m.start()), m[0], kind, (m[1],))))
    for _, figure in sorted(found, key=lambda pair: pair[0]):
        yield figure


def is_held(figure: Figure, files: dict[str, Held]) -> bool:
    for held in files.values():
        if figure.kind == "interval":
            for group in held.groups:
                if all(any(rounds_to(v, n) for v in group) for n in figure.numbers):
                    return True
        elif figure.kind == "ratio":
            if any(rounds_to(v, figure.numbers[0]) for v in held.ratios):
                return True
        elif any(rounds_to(v, figure.numbers[0]) for v in held.detectable_pct):
            return True
    return False


def unheld(pages: list[Path], root: Path, files: dict[str, Held]) -> list[str]:
    return [
        f"{f.where}: {f.quoted!r}"
        for page in pages
        for f in figures_in(page, str(page.relative_to(root)))
        if " ".join(f.quoted.split()) not in ALLOWED and not is_held(f, files)
    ]


@pytest.fixture(scope="module")
def files() -> dict[str, Held]:
    return result_files()


def test_every_quoted_figure_is_held_by_a_result_file(files: dict[str, Held]) -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [f for page in pages for f in figures_in(page, page.name)]
    assert len(found) > 20  # the patterns still see the pages' figures
    assert unheld(pages, REPO, files) == []


def test_a_made_up_figure_is_caught(files: dict[str, Held], tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    held = [
        "B/A of P90 interactivity 1.323 (95% CI 1.318-1.327), held.",
        "The headline gave B/A 0.873; a no-difference verdict next to",
    ]
    made_up = [
        "a run that gave B/A 1.643 (1.512-1.779) on the",
        "H200, B/A 1.917 at\nconcurrency 8, and could detect +-13.9% there;",
        "a prediction of 0.874, 95% CI 0.803-0.931.",
        "| P90 interactivity | higher | 99.2 | 123.2 | 1.599 | 1.411 – 1.802 | better |",
    ]
    page.write_text("\n".join([*held, *made_up]) + "\n")
    assert unheld([page], tmp_path, files) == [
        "page.md:3: 'B/A 1.643'",
        "page.md:3: '1.643 (1.512-1.779)'",
        "page.md:4: 'B/A 1.917'",
        "page.md:5: 'could detect +-13.9%'",
        "page.md:6: '0.874, 95% CI 0.803-0.931'",
        "page.md:7: ' 1.599 | 1.411 – 1.802 '",
    ]


def test_a_figure_matches_at_its_own_precision() -> None:
    assert rounds_to(1.0781, "1.078") and rounds_to(1.0781, "1.08")
    assert not rounds_to(1.0786, "1.078") and not rounds_to(1.0781, "1.0781000001")
