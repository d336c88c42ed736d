"""report.html opens offline in headless Chromium, without console errors, with every plot drawn."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agentab.analysis.compare import compare_runs
from agentab.analysis.html import write_html
from agentab.analysis.load import load_run

from .rundirs import manifest, synthetic_records, write_run

FIGURES = 6  # ITL CDF, TTFT CDF, interactivity histogram, ITL vs context, throughput, cache hits


def _chromium_args(chromium: str, profile: Path) -> list[str]:
    return [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--proxy-server=127.0.0.1:9",  # any network fetch fails: the page must be self-contained
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=10000",  # let every script and timer run before the capture
    ]


def probe_in_frame(chromium: str, page: Path, width: int, tmp: Path, script: str) -> str:
    """The string `script` computes from `page` laid out in a `width`-pixel frame.

    A headless browser prints no layout, so a wrapper page loads the report in a frame of that
    width, runs `script` (a JS expression over `d`, the frame's document) once the frame has
    loaded and its plots have drawn, and writes the result into its own title, which --dump-dom
    shows."""
    wrapper = tmp / "probe.html"
    wrapper.write_text(
        '<!DOCTYPE html><html><head><title>pending</title></head><body style="margin:0">'
        f'<iframe id="f" src="{page.resolve().as_uri()}" '
        f'style="width:{width}px;height:1500px;border:0"></iframe><script>'
        "document.getElementById('f').onload = function () {"
        " var d = this.contentDocument; setTimeout(function () {"
        f" document.title = 'probe:' + ({script}); }}, 1000); }};"
        "</script></body></html>"
    )
    args = [*_chromium_args(chromium, tmp / "probe-profile"), "--allow-file-access-from-files"]
    command = [*args, "--dump-dom", wrapper.resolve().as_uri()]
    dom = subprocess.run(command, capture_output=True, text=True, timeout=120).stdout
    found = re.search(r"<title>probe:(.*?)</title>", dom, re.DOTALL)
    assert found is not None, dom[:500]
    return html.unescape(found.group(1))


def overflow_px(chromium: str, page: Path, width: int, tmp: Path) -> int:
    """How many pixels `page` is wider than a `width`-pixel window (0: no horizontal scroll)."""
    script = "d.documentElement.scrollWidth - d.documentElement.clientWidth"
    return int(probe_in_frame(chromium, page, width, tmp, script))


@pytest.fixture(scope="module")
def report_html(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("html")
    a, b = [], []
    for k in range(2):
        a.append(write_run(root / f"a{k}", synthetic_records(10 + k), manifest(seed=10 + k)))
        b.append(
            write_run(
                root / f"b{k}",
                synthetic_records(10 + k, itl_scale=0.6, ttft_scale=1.1),
                manifest(decode_backend="latency_specialized", arm="latency_specialized"),
            )
        )
    comparison = compare_runs([load_run(p) for p in a], [load_run(p) for p in b], resamples=500)
    return write_html(comparison, root / "report.html", title="synthetic A/B")


def test_report_embeds_plotly_and_fetches_nothing(report_html: Path) -> None:
    text = report_html.read_text()
    assert "<script src=" not in text and "<link" not in text  # nothing loaded from elsewhere
    assert len(text) > 3_000_000  # plotly.js itself is inlined
    assert text.count('class="plotly-graph-div"') == FIGURES
    assert "P90 interactivity = 1/P90(ITL)" in text


@pytest.mark.chromium
def test_report_opens_in_headless_chromium(
    report_html: Path, chromium_path: str, tmp_path: Path
) -> None:
    shot = tmp_path / "report.png"
    args = _chromium_args(chromium_path, tmp_path / "profile")
    url = report_html.resolve().as_uri()
    run = subprocess.run(
        [*args, f"--screenshot={shot}", "--window-size=1300,5200", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    assert shot.stat().st_size > 50_000  # a page of plots, not a blank one
    dom = subprocess.run(
        [*args, "--dump-dom", url], capture_output=True, text=True, timeout=120
    ).stdout
    # Plotly replaces each figure's div content with its SVG layers once the JS has run.
    assert len(re.findall(r'<svg class="main-svg"', dom)) >= FIGURES
    keep = os.environ.get("AGENTAB_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shot, Path(keep) / "report.png")


def test_without_plotly_the_page_keeps_its_tables(
    report_html: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from agentab.analysis.html import comparison_html

    from .rundirs import synthetic_records as records

    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly -> ImportError
    monkeypatch.setitem(sys.modules, "plotly.offline", None)
    run = write_run(report_html.parent / "np-a", records(2), manifest())
    from agentab.errors import AgentabWarning
    from agentab.extras import install_command

    comparison = compare_runs([load_run(run)], [load_run(run)], resamples=100)
    with pytest.warns(AgentabWarning, match="the HTML report has no plots"):
        page = comparison_html(comparison)
    assert "<table>" in page and "plotly-graph-div" not in page
    assert f"<code>{install_command('report')}</code>" in page


def test_the_histogram_shares_its_bins_and_normalises_each_arm(tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    from agentab.analysis.html import _figures, log_ticks

    a = write_run(tmp_path / "a", synthetic_records(3, sessions=20), manifest())
    b = write_run(
        tmp_path / "b",
        synthetic_records(4, sessions=12, itl_scale=0.7),
        manifest(decode_backend="latency_specialized", arm="ls"),
    )
    comparison = compare_runs([load_run(a)], [load_run(b)], resamples=100)
    hist = _figures(comparison)[2]
    first, second = hist.data[0], hist.data[1]
    assert first.histnorm == second.histnorm == "percent"
    assert first.xbins.to_plotly_json() == second.xbins.to_plotly_json()
    lo = min(min(first.x), min(second.x))
    hi = max(max(first.x), max(second.x))
    assert first.xbins.start == lo and first.xbins.end == hi
    assert first.xbins.size == pytest.approx((hi - lo) / 80)
    # Log axes: every tick labelled in full, 1-2-5 per decade.
    cdf = _figures(comparison)[0]
    assert list(cdf.layout.xaxis.ticktext) == [f"{t:g}" for t in cdf.layout.xaxis.tickvals]
    import numpy as np

    assert log_ticks(np.array([9.0, 31.0])) == [5.0, 10.0, 20.0, 50.0]


@pytest.mark.chromium
def test_report_fits_a_1280_pixel_window(
    report_html: Path, chromium_path: str, tmp_path: Path
) -> None:
    assert overflow_px(chromium_path, report_html, 1280, tmp_path) == 0
