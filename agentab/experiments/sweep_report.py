"""The sweep report: the recommendation first, then one table row and one marker per load point.

`sweep.json` carries the same as data (every point's arms, B/A with its CI and verdict, and the
recommendation) for CI gating. `report.html` adds three plots: the frontier (P90 interactivity
against throughput per GPU, per arm, error bars over the runs), the B/A ratio of P90
interactivity per point with its CI, and the share of decode steps the specialized path served.
Each point's full A/B report is in its own folder (`<variable>-<point>/report.md`).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from agentab.analysis.frontier import HEADLINE, THROUGHPUT, point_json, point_verdict
from agentab.analysis.html import COLORS, html_table, md_inline, report_page
from agentab.analysis.markdown import DEFINITIONS, fmt, markdown_table, setup_lines
from agentab.analysis.recommend import Recommendation, recommend
from agentab.experiments.experiment import Experiment
from agentab.experiments.sweep import SweepPoint

TABLE_HEADER = [
    "point",
    "A P90 interactivity",
    "B P90 interactivity",
    "B/A",
    "95% CI",
    "verdict",
    "could detect",
    "A tok/s/GPU",
    "B tok/s/GPU",
    "A tok/s/GPU (uncached)",
    "B tok/s/GPU (uncached)",
    "B specialized share",
]


def sweep_recommendation(experiment: Experiment, points: Sequence[SweepPoint]) -> Recommendation:
    assert experiment.sweep is not None
    return recommend(
        experiment.sweep.variable,
        experiment.arms[1].name,
        [point_verdict(p.point, p.comparison) for p in points],
    )


def sweep_json(experiment: Experiment, points: Sequence[SweepPoint]) -> dict[str, Any]:
    assert experiment.sweep is not None
    return {
        "experiment": experiment.name,
        "arms": {"a": experiment.arms[0].name, "b": experiment.arms[1].name},
        "variable": experiment.sweep.variable,
        "confidence": experiment.confidence,
        "recommendation": sweep_recommendation(experiment, points).to_json(),
        "points": [point_json(p.point, p.comparison) for p in points],
    }


def _value(arm: dict[str, Any], name: str) -> float | None:
    entry = arm.get(name) or {}
    return entry.get("value")


def _rows(data: dict[str, Any]) -> list[list[str]]:
    rows = []
    for p in data["points"]:
        a, b = p["a"], p["b"]
        ci = "–" if p["ci_low"] is None else f"{p['ci_low']:.3f} – {p['ci_high']:.3f}"
        rows.append(
            [
                f"{data['variable']} {p['point']:g}",
                fmt(_value(a, HEADLINE), "tok/s/user"),
                fmt(_value(b, HEADLINE), "tok/s/user"),
                "–" if p["ratio"] is None else f"{p['ratio']:.3f}",
                ci,
                p["verdict"],
                "–"
                if p.get("detectable_change") is None
                else f"+-{100 * p['detectable_change']:.1f}%",
                fmt(_value(a, THROUGHPUT), "tok/s/GPU"),
                fmt(_value(b, THROUGHPUT), "tok/s/GPU"),
                fmt(_value(a, "throughput_per_gpu_uncached_tok_s"), "tok/s/GPU"),
                fmt(_value(b, "throughput_per_gpu_uncached_tok_s"), "tok/s/GPU"),
                fmt(_value(b, "specialized_decode_share"), ""),
            ]
        )
    return rows


def _setup(experiment: Experiment, points: Sequence[SweepPoint]) -> list[str]:
    assert experiment.sweep is not None
    sweep = experiment.sweep
    lines = [
        f"- Sweep over {sweep.variable}: {', '.join(f'{p.point:g}' for p in points)}; "
        f"{experiment.repeats} repeat(s) per arm at every point, run interleaved A B A B with "
        "the same seeds in both arms; each point's A/B report is in its folder "
        f"(`{sweep.variable}-N/report.md`).",
    ]
    if points:  # the setup lines every point shares (GPUs, engine, bootstrap, caveats)
        first = points[0].comparison
        manifest = first.runs_a[0].run.manifest if first.runs_a else {}
        replay = manifest.get("replay")
        if not isinstance(replay, dict):
            replay = {}
        lines += [
            line
            for line in setup_lines(first, experiment.notes)
            if not line.startswith(("- Arms:", "- Workload"))
        ]
        lines.append(
            f"- Workload {str(manifest.get('workload_hash'))[:12]}; profiling window "
            f"{replay.get('duration_s', '?')} s per run, warmup "
            f"{replay.get('warmup_requests', '?')} requests per lane."
        )
    return lines


def sweep_markdown(experiment: Experiment, points: Sequence[SweepPoint], data: dict) -> str:
    a, b = experiment.arms
    lines = [
        f"**Recommendation**: {data['recommendation']['line']}.",
        "",
        f"# Sweep report: {experiment.name}: {a.name} (A) vs {b.name} (B)",
        "",
        *_setup(experiment, points),
        "",
        *markdown_table(TABLE_HEADER, _rows(data)),
        "",
        "Definitions:",
        *DEFINITIONS,
    ]
    return "\n".join(lines) + "\n"


def _figures(data: dict[str, Any]) -> list:  # list[plotly Figure]
    import plotly.graph_objects as go

    variable = data["variable"]
    points = data["points"]
    labels = [f"{variable} {p['point']:g}" for p in points]
    frontier = go.Figure()
    positions = _label_positions(points)
    for side, color in zip(("a", "b"), COLORS, strict=True):
        name = data["arms"][side]
        xs = [p[side][THROUGHPUT] for p in points]
        ys = [p[side][HEADLINE] for p in points]
        frontier.add_scatter(
            x=[x["value"] for x in xs],
            y=[y["value"] for y in ys],
            name=name,
            mode="lines+markers+text",
            text=[f"{p['point']:g}" for p in points],
            textposition=positions[side],
            hovertext=labels,
            marker={"color": color, "size": 9},
            line={"color": color},
            error_y=_error_bars(ys),
            error_x=_error_bars(xs),
        )
    frontier.update_layout(
        title=f"Frontier: P90 interactivity vs throughput per GPU (labels: {variable}; "
        "error bars: range over the runs)",
        xaxis_title="throughput per GPU (input incl. cached + output), tok/s/GPU",
        yaxis_title="P90 interactivity = 1/P90(ITL), tok/s/user",
    )
    ratio = go.Figure()
    values = [p["ratio"] for p in points]
    ratio.add_scatter(
        x=labels,
        y=values,
        name=f"B/A ({data['arms']['b']} / {data['arms']['a']})",
        mode="markers",
        marker={"color": COLORS[1], "size": 10},
        error_y={
            "type": "data",
            "symmetric": False,
            "array": [_gap(p["ci_high"], p["ratio"]) for p in points],
            "arrayminus": [_gap(p["ratio"], p["ci_low"]) for p in points],
        },
        hovertext=[p["verdict"] for p in points],
    )
    ratio.add_hline(y=1.0, line={"color": "#555", "dash": "dash"})
    ratio.update_layout(
        title=f"B/A of P90 interactivity per point, with its {100 * data['confidence']:.0f}% CI "
        "(above 1: B is faster)",
        xaxis_title=variable,
        yaxis_title="B/A",
    )
    share = go.Figure()
    for side, color in zip(("a", "b"), COLORS, strict=True):
        share.add_bar(
            x=labels,
            y=[p[side]["specialized_decode_share"]["value"] for p in points],
            name=data["arms"][side],
            marker={"color": color},
        )
    share.update_layout(
        title="Share of decode steps served by the specialized path (engine counters)",
        xaxis_title=variable,
        yaxis_title="share of decode steps",
        yaxis_range=[0, 1.02],
        barmode="group",
    )
    return [frontier, ratio, share]


def _label_positions(points: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
    """Where each arm's point label goes: to the right of the marker, clear of its own error bars,
    above it for the arm that is higher at that point and below it for the other.

    Both arms sit close together where they are equivalent (the same throughput and
    interactivity): labels on the same side of both markers would run into each other ("3232")
    and into the other arm's horizontal error bar."""
    positions: dict[str, list[str]] = {"a": [], "b": []}
    for p in points:
        a_on_top = (p["a"][HEADLINE]["value"] or 0) > (p["b"][HEADLINE]["value"] or 0)
        positions["a"].append("top right" if a_on_top else "bottom right")
        positions["b"].append("bottom right" if a_on_top else "top right")
    return positions


def _gap(high: float | None, low: float | None) -> float | None:
    return None if high is None or low is None else high - low


def _error_bars(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "data",
        "symmetric": False,
        "array": [_gap(e["max"], e["value"]) for e in entries],
        "arrayminus": [_gap(e["value"], e["min"]) for e in entries],
    }


def sweep_html(experiment: Experiment, points: Sequence[SweepPoint], data: dict) -> str:
    """The self-contained sweep page (plotly JS inlined once)."""
    a, b = experiment.arms
    heading = f"{experiment.name}: {a.name} (A) vs {b.name} (B)"
    body = [
        f'<p class="headline"><b>Recommendation</b>: '
        f"{html.escape(data['recommendation']['line'])}.</p>",
        f"<h1>Sweep report: {html.escape(heading)}</h1>",
        "<ul>" + "".join(f"<li>{md_inline(x[2:])}</li>" for x in _setup(experiment, points)),
        "</ul>",
        html_table(TABLE_HEADER, _rows(data)),
    ]
    return report_page(f"agentab sweep: {heading}", body, lambda: _figures(data), 480)


def write_sweep_reports(
    experiment: Experiment, points: Sequence[SweepPoint], out_dir: Path
) -> tuple[dict[str, Any], str]:
    """Write sweep.json, report.md and report.html; returns the JSON object and the Markdown."""
    data = sweep_json(experiment, points)
    (out_dir / "sweep.json").write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    markdown = sweep_markdown(experiment, points, data)
    (out_dir / "report.md").write_text(markdown, encoding="utf-8")
    (out_dir / "report.html").write_text(sweep_html(experiment, points, data), encoding="utf-8")
    return data, markdown
