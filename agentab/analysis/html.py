"""report.html: the comparison as plots a serving engineer looks at, offline.

Plotly draws the figures (interactive zoom and hover, maintained, and its JavaScript can be
embedded so the file opens with no network). The JS is inlined once in <head>; every figure is a
div that refers to it. Large samples are thinned before plotting (CDFs to 1,000 quantiles,
scatters to a seeded subsample) so a report of a long run stays a few megabytes.

Figures: ITL and TTFT CDFs per arm; the per-request interactivity distribution with each arm's
P90 interactivity (1/P90(ITL)) marked; ITL against context length; output throughput over time;
cache-hit ratio over time (client-side, and server-side when counters were scraped).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from agentab.analysis.compare import Comparison
from agentab.analysis.markdown import (
    DEFINITIONS,
    TABLE_HEADER,
    breakdown_sections,
    confounded_line,
    headline_line,
    metric_rows,
    server_rows,
    setup_lines,
)
from agentab.analysis.metrics import chunk_table
from agentab.analysis.sample import METRICS
from agentab.analysis.summary import RunSummary

COLORS = ("#1f77b4", "#e4572e")
CDF_POINTS = 1000
SCATTER_POINTS = 4000
TIME_BINS = 60


def _ok(summary: RunSummary) -> pl.DataFrame:
    return summary.requests.filter(pl.col("ok") & (pl.col("phase") == "profiling"))


def _pooled(runs: Sequence[RunSummary], column: str) -> np.ndarray:
    frames = [_ok(s).select(column).drop_nulls() for s in runs]
    return pl.concat(frames)[column].to_numpy() if frames else np.array([])


def _cdf(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if values.size == 0:
        return np.array([]), np.array([])
    probs = np.linspace(0.0, 1.0, min(CDF_POINTS, values.size))
    return np.quantile(values, probs), probs


def md_inline(text: str) -> str:
    """The few inline markdown marks the shared lines use (**bold**, `code`), escaped."""
    parts = html.escape(text).split("**")
    text = "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))
    parts = text.split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


HISTOGRAM_BINS = 80


def shared_bins(values: list[np.ndarray], bins: int) -> dict[str, float] | None:
    """Equal-width bins over every arm's values together (plotly's `xbins`)."""
    finite = [v[np.isfinite(v)] for v in values]
    both = np.concatenate(finite) if finite else np.zeros(0)
    if both.size == 0 or both.min() == both.max():
        return None
    lo, hi = float(both.min()), float(both.max())
    return {"start": lo, "end": hi, "size": (hi - lo) / bins}


def log_ticks(values: np.ndarray) -> list[float]:
    """1-2-5 ticks covering `values` on a log axis, each labelled in full ("2", "5", "10").

    plotly's own log ticks label the minor ones with their leading digit only, so an axis
    read "9, 10, 2, 3"."""
    v = values[np.isfinite(values) & (values > 0)]
    if v.size == 0:
        return []
    lo, hi = math.floor(math.log10(v.min())), math.ceil(math.log10(v.max()))
    ticks = [m * 10.0**k for k in range(lo, hi + 1) for m in (1, 2, 5)]
    inside = [t for t in ticks if v.min() / 2 <= t <= v.max() * 2]
    return [float(f"{t:.6g}") for t in inside]


def _figures(comparison: Comparison) -> list:  # list[plotly.graph_objects.Figure]
    import plotly.graph_objects as go

    arms = ((comparison.arm_a, comparison.runs_a), (comparison.arm_b, comparison.runs_b))
    figs = []
    for column, title, axis in (
        ("itl_s", "ITL CDF (inter-token latency per request)", "ITL (ms)"),
        ("ttft_s", "TTFT CDF", "TTFT (ms)"),
    ):
        fig = go.Figure()
        shown = []
        for (name, runs), color in zip(arms, COLORS, strict=True):
            x, y = _cdf(_pooled(runs, column))
            shown.append(x * 1000)
            fig.add_scatter(x=x * 1000, y=y, name=name, mode="lines", line={"color": color})
        fig.update_layout(title=title, xaxis_title=axis, yaxis_title="fraction of requests")
        ticks = log_ticks(np.concatenate(shown)) if shown else []
        fig.update_xaxes(type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])
        figs.append(fig)

    # One set of bins for both arms, as a share of each arm's requests: the arms differ in how
    # many requests they measured, and bins chosen per arm would not line up.
    values = [_pooled(runs, "interactivity_tok_s") for _, runs in arms]
    edges = shared_bins(values, HISTOGRAM_BINS)
    fig = go.Figure()
    for (name, _), color, x in zip(arms, COLORS, values, strict=True):
        fig.add_histogram(
            x=x,
            name=f"{name}: 1/ITL_i",
            marker={"color": color},
            opacity=0.55,
            histnorm="percent",
            xbins=None if edges is None else edges,
        )
    for (name, _), color, key in zip(arms, COLORS, ("a", "b"), strict=True):
        value = getattr(comparison.metrics["p90_interactivity_tok_s"], key)
        if value is not None:
            fig.add_vline(
                x=value,
                line={"color": color, "dash": "dash", "width": 2},
                annotation_text=f"{name} P90 interactivity {value:.1f}",
                annotation_position="top right" if key == "b" else "top left",
            )
    fig.update_layout(
        title="Interactivity per request (1/ITL_i); dashed: P90 interactivity = 1/P90(ITL)",
        xaxis_title="tokens/s per user",
        yaxis_title="% of the arm's requests",
        barmode="overlay",
    )
    figs.append(fig)

    fig = go.Figure()
    rng = np.random.default_rng(0)
    for (name, runs), color in zip(arms, COLORS, strict=True):
        frame = pl.concat([_ok(s).select("prompt_tokens", "itl_s").drop_nulls() for s in runs])
        if frame.height > SCATTER_POINTS:
            frame = frame[np.sort(rng.choice(frame.height, SCATTER_POINTS, replace=False))]
        fig.add_scatter(
            x=frame["prompt_tokens"].to_numpy(),
            y=frame["itl_s"].to_numpy() * 1000,
            name=name,
            legendgroup=name,
            mode="markers",
            marker={"color": color, "size": 4, "opacity": 0.4},
        )
        median = _binned_median(runs)
        fig.add_scatter(
            x=median["x"].to_numpy(),
            y=median["y"].to_numpy() * 1000,
            name=f"{name} median",
            legendgroup=name,
            mode="lines+markers",
            line={"color": color, "width": 3},
        )
    fig.update_layout(
        title="ITL against context length (prompt tokens); lines: median per length bin",
        xaxis_title="prompt tokens",
        yaxis_title="ITL (ms)",
    )
    figs.append(fig)
    figs.append(_over_time(comparison, arms, "throughput"))
    figs.append(_over_time(comparison, arms, "cache"))
    return figs


def _number(value: object) -> float:
    """An aggregate of a non-empty numeric column as a float (polars types a Series' min and
    max as any Python literal or None)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _binned_median(runs: Sequence[RunSummary], bins: int = 20) -> pl.DataFrame:
    """Median ITL per prompt-length bin (equal-width bins over the arm's prompt range)."""
    frame = pl.concat([_ok(s).select("prompt_tokens", "itl_s").drop_nulls() for s in runs])
    if frame.is_empty():
        return pl.DataFrame({"x": [], "y": []})
    lo, hi = _number(frame["prompt_tokens"].min()), _number(frame["prompt_tokens"].max())
    width = max((hi - lo) / bins, 1.0)
    return (
        frame.group_by(b=((pl.col("prompt_tokens") - lo) / width).floor())
        .agg(x=pl.col("prompt_tokens").mean(), y=pl.col("itl_s").median(), n=pl.len())
        .filter(pl.col("n") >= 5)
        .sort("x")
    )


def _over_time(comparison: Comparison, arms, kind: str):  # -> plotly Figure
    import plotly.graph_objects as go

    fig = go.Figure()
    for (name, runs), color in zip(arms, COLORS, strict=True):
        for i, summary in enumerate(runs):
            start = summary.values.get("phase_start_s")
            ok = _ok(summary)
            if ok.is_empty():
                continue
            t0 = _number(ok["sent_s"].min()) if start is None else start
            wall = summary.values.get("phase_wall_s") or 1.0
            width = max(wall / TIME_BINS, 1e-9)
            if kind == "throughput":
                chunks = chunk_table(summary.run.records).collect()
                binned = (
                    chunks.with_columns(bin=((pl.col("t_s") - t0) / width).floor())
                    .group_by("bin")
                    .agg(y=pl.col("tokens").sum() / width)
                    .sort("bin")
                )
            else:
                binned = (
                    ok.filter(pl.col("cached_tokens").is_not_null())
                    .with_columns(bin=((pl.col("sent_s") - t0) / width).floor())
                    .group_by("bin")
                    .agg(y=pl.col("cached_tokens").sum() / pl.col("prompt_tokens").sum())
                    .sort("bin")
                )
            fig.add_scatter(
                x=(binned["bin"].to_numpy() + 0.5) * width,
                y=binned["y"].to_numpy(),
                name=f"{name} run {i + 1}",
                legendgroup=name,
                mode="lines",
                line={"color": color, "dash": "solid" if i == 0 else "dot"},
            )
            if kind == "cache":
                _add_server_cache(fig, summary, t0, name, i, color)
    if kind == "throughput":
        fig.update_layout(
            title="Output throughput over time (all requests, per run)",
            xaxis_title="seconds into the profiling phase",
            yaxis_title="output tokens/s",
        )
    else:
        fig.update_layout(
            title="Cache-hit ratio over time (client: cached / prompt tokens by send time)",
            xaxis_title="seconds into the profiling phase",
            yaxis_title="hit ratio",
            yaxis_range=[0, 1.02],
        )
    return fig


def _add_server_cache(fig, summary: RunSummary, t0: float, name: str, i: int, color: str) -> None:
    metrics = summary.run.server_metrics.collect()
    wide = (
        metrics.filter(
            pl.col("name").is_in(
                ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"]
            )
        )
        .group_by("t_s", "name")
        .agg(pl.col("value").sum())
        .pivot(on="name", index="t_s", values="value")
        .sort("t_s")
    )
    if wide.height < 2 or wide.width < 3:
        return
    hits = wide["vllm:prefix_cache_hits_total"].diff()
    queries = wide["vllm:prefix_cache_queries_total"].diff()
    ratio = (hits / queries).to_numpy()
    fig.add_scatter(
        x=wide["t_s"].to_numpy() - t0,
        y=ratio,
        name=f"{name} run {i + 1} (server)",
        legendgroup=name,
        mode="lines",
        line={"color": color, "dash": "dashdot", "width": 1},
    )


def report_page(title: str, body: list[str], figures: Any, height: int) -> str:
    """A self-contained report page: `body` (HTML parts), then the plots that `figures()`
    makes (plotly JS inlined once, so the file opens without a network; without plotly the page
    keeps its tables and says how to get the plots), then the metric definitions."""
    try:
        import plotly.offline
    except ImportError:
        plotly = None
    body = list(body)
    head_js = ""
    if plotly is not None:
        head_js = f'<script type="text/javascript">{plotly.offline.get_plotlyjs()}</script>'
        for fig in figures():
            fig.update_layout(template="plotly_white", height=height, margin={"t": 60})
            body.append(fig.to_html(full_html=False, include_plotlyjs=False))
    else:
        body.append("<p>Plots need plotly: <code>pip install 'agentab[report]'</code>.</p>")
    body.append("<h2>Definitions</h2><ul>")
    body += [f"<li>{md_inline(d[2:])}</li>" for d in DEFINITIONS]
    body.append("</ul>")
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title>{head_js}<style>{CSS}</style></head>"
        f"<body>{''.join(body)}</body></html>"
    )


def comparison_html(
    comparison: Comparison, *, title: str | None = None, header: Sequence[str] = ()
) -> str:
    """The self-contained report page (plotly JS inlined; no network needed to open it)."""
    heading = title or f"{comparison.arm_a} vs {comparison.arm_b}"
    body: list[str] = []
    if comparison.confounded_by:
        line = md_inline(confounded_line(comparison.differences))
        body.append(f'<p class="confounded">{line}</p>')
    body.append(f"<h1>A/B report: {html.escape(heading)}</h1>")
    body.append(
        "<ul>"
        + "".join(f"<li>{md_inline(x[2:])}</li>" for x in setup_lines(comparison, header))
        + "</ul>"
    )
    headline = headline_line(comparison)
    body.append(f'<p class="headline">{md_inline(headline)}</p>')
    rows = metric_rows(comparison, [m.name for m in METRICS])  # goodput added when set
    body.append(html_table(TABLE_HEADER, rows))
    server = server_rows(comparison)
    if server:
        body.append(html_table(["server metric", "A per run", "B per run"], server))
    for title, head, brows in breakdown_sections(comparison):
        body.append(f"<p>{html.escape(title)}:</p>")
        body.append(html_table(head, brows))
    return report_page(f"agentab: {heading}", body, lambda: _figures(comparison), 420)


_VERDICT_CLASS = {"better": "better", "worse": "worse"}


def html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="{_VERDICT_CLASS.get(c, "")}">{html.escape(c)}</td>' for c in row)
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1200px; color: #222; }
table { border-collapse: collapse; font-size: 13px; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; white-space: nowrap; }
td:first-child, th:first-child { text-align: left; white-space: normal; }
tbody tr:first-child { font-weight: bold; }
td.better { color: #11702a; font-weight: bold; }
td.worse { color: #b00020; font-weight: bold; }
.confounded { background: #fde2e2; border: 2px solid #c00; padding: 0.6em; font-size: 1.1em; }
.headline { font-size: 1.15em; }
"""


def write_html(comparison: Comparison, path: Path, **kwargs) -> Path:
    path.write_text(comparison_html(comparison, **kwargs), encoding="utf-8")
    return path
