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

from tests.analysis.test_html import _chromium_args, overflow_px, probe_in_frame

# Over the frontier (the report's first plot): every point label's box against every error bar's
# box and, widened by 1 px on each side, against every other label's (two labels that touch read
# as one number: "3232"). Plotly draws a trace's labels in `.textpoint text` and its error bars in
# `.errorbar path` (one x and one y path per point).
FRONTIER_OVERLAPS = """(function () {
  var plot = d.querySelectorAll('.js-plotly-plot')[0];
  function box(e, pad) {
    var r = e.getBoundingClientRect();
    return [r.left - pad, r.top - pad, r.right + pad, r.bottom + pad];
  }
  function cross(a, b) {
    var across = Math.min(a[2], b[2]) > Math.max(a[0], b[0]);
    return across && Math.min(a[3], b[3]) > Math.max(a[1], b[1]);
  }
  var labels = [], bars = [];
  plot.querySelectorAll('.scatterlayer .trace').forEach(function (trace, t) {
    trace.querySelectorAll('.textpoint text').forEach(function (e) {
      labels.push({name: 'arm ' + t + ' label ' + e.textContent, box: box(e, 0), wide: box(e, 1)});
    });
    trace.querySelectorAll('.errorbar path').forEach(function (e, i) {
      var name = 'arm ' + t + ' point ' + Math.floor(i / 2) + ' ' + e.getAttribute('class');
      bars.push({name: name, box: box(e, 0)});
    });
  });
  var overlaps = [];
  labels.forEach(function (l, i) {
    bars.forEach(function (b) {
      if (cross(l.box, b.box)) overlaps.push(l.name + ' on ' + b.name);
    });
    labels.slice(i + 1).forEach(function (m) {
      if (cross(l.wide, m.wide)) overlaps.push(l.name + ' on ' + m.name);
    });
  });
  return JSON.stringify({labels: labels.length, bars: bars.length, overlaps: overlaps});
})()"""
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


@pytest.mark.chromium
def test_the_frontier_labels_clear_the_error_bars_and_each_other(
    example: Path, chromium_path: str, tmp_path: Path
) -> None:
    found = json.loads(
        probe_in_frame(chromium_path, example / "report.html", 1280, tmp_path, FRONTIER_OVERLAPS)
    )
    # 5 points x 2 arms, each with an x and a y error bar: the probe saw the whole plot
    assert (found["labels"], found["bars"]) == (10, 20)
    assert found["overlaps"] == []
