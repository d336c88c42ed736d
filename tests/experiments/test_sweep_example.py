"""The sweep example end to end: its report leads with the recommendation and, opened offline in
headless Chromium, draws the frontier, the ratio per point and the specialized share without a
console error."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.analysis.test_html import _chromium_args, overflow_px

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sweep-gb300-tp16.toml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep-example") / "out"
    result = subprocess.run(
        [sys.executable, "-m", "agentab", "ab", str(EXAMPLE), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return out


def test_every_point_of_the_example_gets_a_verdict(example: Path) -> None:
    data = json.loads((example / "sweep.json").read_text())
    assert [p["point"] for p in data["points"]] == [2, 4, 8, 16, 32]
    assert all(p["verdict_withheld"] == [] for p in data["points"])
    rec = data["recommendation"]
    # the specialized path pays off at low load and stops paying off once it serves few steps
    # better at low load; past the crossover (8 or 16, the point where the specialized share
    # falls) no gain is left, whether an interval lands inside +-3% (equivalent) or just outside
    crossover = rec["crossover"]
    assert crossover["last_better"] in (8, 16) and crossover["next"] in (16, 32)
    assert crossover["next_verdict"] in ("equivalent", "no significant difference")
    verdicts = {p["point"]: p["verdict"] for p in data["points"]}
    assert [verdicts[c] for c in (2, 4, 8)] == ["better"] * 3
    assert verdicts[32] in ("equivalent", "no significant difference")
    assert rec["worse_points"] == []
    shares = [p["b"]["specialized_decode_share"]["value"] for p in data["points"]]
    assert shares == sorted(shares, reverse=True) and shares[0] == 1.0 and shares[-1] < 0.5
    text = (example / "report.md").read_text()
    assert text.startswith(f"**Recommendation**: {rec['line']}.\n")


@pytest.mark.chromium
def test_the_example_report_renders_in_headless_chromium(
    example: Path, chromium_path: str, tmp_path: Path
) -> None:
    page = example / "report.html"
    args = _chromium_args(chromium_path, tmp_path / "profile")
    url = page.resolve().as_uri()
    shot = tmp_path / "sweep.png"
    run = subprocess.run(
        [*args, f"--screenshot={shot}", "--window-size=1300,2600", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    assert shot.stat().st_size > 50_000
    dom = subprocess.run(
        [*args, "--dump-dom", url], capture_output=True, text=True, timeout=120
    ).stdout
    assert len(re.findall(r'<svg class="main-svg"', dom)) >= 3
    assert "Frontier: P90 interactivity vs throughput per GPU" in dom
    assert "B/A of P90 interactivity per point" in dom
    assert "Share of decode steps served by the specialized path" in dom
    assert "<b>Recommendation</b>: latency_specialized raises P90 interactivity" in dom
    # the point table is wide: it scrolls inside its own box, the page does not
    assert overflow_px(chromium_path, page, 1280, tmp_path) == 0
