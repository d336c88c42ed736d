"""Markdown reports: one run's summary table, and the A/B comparison printed by `ab`/`compare`.

A confounded comparison says so in its very first line, before anything a reader could quote.
Each figure carries its definition where a number could be misread: the headline is
1/P90(ITL) (InferenceX), the percentiles of 1/ITL_i are labelled as the other definition, and
the direction of "better" is stated per metric (lower is better for latencies and errors).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from agentab.analysis.breakdown import BREAKDOWNS
from agentab.analysis.caveats import simulator_caveats, synthetic_acceptance_caveats
from agentab.analysis.compare import EQUIVALENT, WITHHELD, Comparison, MetricResult
from agentab.analysis.faults import FAULT_HEADER, FAULTS_TITLE, fault_rows
from agentab.analysis.guard import Difference
from agentab.analysis.intervals import t_quantile
from agentab.analysis.sample import GOODPUT
from agentab.analysis.status import describe_status, incomplete_line
from agentab.analysis.summary import DISTRIBUTIONS, SPREAD_KEYS, STAT_KEYS, RunSummary

# The rows of the printed comparison table (compare --json and report.html have them all).
TABLE_METRICS: tuple[str, ...] = (
    "p90_interactivity_tok_s",
    "itl_s.p50",
    "itl_s.p90",
    "itl_s.p99",
    "ttft_s.p50",
    "ttft_s.p90",
    "ttft_s.p99",
    "e2e_s.p50",
    "e2e_s.p90",
    "e2e_s.p99",
    "interactivity_tok_s.p50",
    "interactivity_tok_s.p90",
    "decode_throughput_tok_s",
    "output_throughput_tok_s",
    "request_throughput_req_s",
    "throughput_per_gpu_tok_s",
    "throughput_per_gpu_uncached_tok_s",
    "cache_hit_ratio",
    "error_rate",
)

DEFINITIONS = (
    "- **P90 interactivity** (headline, InferenceX) = 1 / P90(ITL): the slow tail of per-user "
    "decode speed, over all successful profiling-phase requests, parents and subagents each once, "
    "linear-interpolated percentile.",
    "- **interactivity pNN** = percentiles of the per-request 1/ITL_i (AIPerf's definition; its "
    "p90 is the *fast* tail): a different number from the headline.",
    "- ITL_i = (last chunk - first chunk) / (OSL_i - 1): AIPerf's ITL, and vLLM bench serve's "
    "TPOT (vLLM's own 'ITL' is the gap between chunks); TTFT = first chunk; E2E = last chunk "
    "(all from the client's send time). Lower is better for ITL, TTFT, E2E and error rate.",
    "- **decode throughput** excludes prefill: decode tokens (OSL_i - 1) / seconds during which at "
    "least one request was decoding. Output throughput = output tokens / profiling wall time. "
    "Throughput per GPU = (input + output tokens) / wall time / GPU count, counting cached input "
    "tokens (as InferenceX does); the uncached figure leaves them out.",
    "- CI of B/A (paired design: repeat k of both arms replays one plan): the latency metrics "
    "compare the requests both arms of each repeat completed; the CI is the paired Student t "
    "interval over the repeats' B/A, never narrower than a percentile bootstrap that resamples "
    "sessions jointly over both arms and every repeat (runs not paired this way: the envelope "
    "of the session bootstrap and a Welch t interval over the runs). Verdict "
    "'better'/'worse' when the CI excludes 1, 'equivalent' when it lies within the equivalence "
    "margin, else 'no significant difference'; 'could detect' is the smallest change the "
    "comparison finds with 80% power.",
)
GOODPUT_DEFINITION = (
    "- **goodput** (with service-level objectives, `--slo`): successful requests within every "
    "limit set (TTFT, ITL_i, E2E) per second of the profiling window, as vLLM bench serve's "
    "`--goodput` and AIPerf count it; **SLO attainment** is their share of all profiling "
    "requests. Both count every request of the window, matched or not."
)


def fmt(value: float | None, unit: str = "") -> str:
    """A human number: seconds below 1 s as ms, rates with one decimal, ratios as percent."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if unit == "s":
        return f"{value * 1000:.1f} ms" if abs(value) < 1 else f"{value:.3f} s"
    if unit == "":
        return f"{100 * value:.1f}%"
    if unit.startswith("tok"):
        return f"{value:,.1f}"
    return f"{value:.4g}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _spread(values: Sequence[float | None], unit: str) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    if len(present) == 1:
        return fmt(present[0], unit)
    return f"{fmt(min(present), unit)} – {fmt(max(present), unit)}"


def _ratio_spread(values: Sequence[float | None]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    return f"{min(present):.3f} – {max(present):.3f}" if len(present) > 1 else f"{present[0]:.3f}"


def confounded_line(differences: Sequence[Difference]) -> str:
    """The first line of a report whose runs differ in an accepted (--allow-diff) field."""
    listed = "; ".join(d.describe() for d in differences if d.allowed)
    return (
        f"**CONFOUNDED by {', '.join(d.field for d in differences if d.allowed)}**: the arms "
        f"also differ in {listed}, so these ratios do not isolate the decode backend."
    )


def _manifest_value(comparison: Comparison, key: str) -> Any:
    values = {str(s.run.manifest.get(key)) for s in comparison.runs_a + comparison.runs_b}
    return values.pop() if len(values) == 1 else " / ".join(sorted(values))


_LIMIT_SOURCES = {
    "option": "set by specialized_max_tokens",
    "measured": "the device's measured dispatch: wider steps lose to the standard path there",
    "vllm-rule": "vLLM's rule; no dispatch measured for this device",
}


def _decoder_note(comparison: Comparison) -> str:
    """Which implementation the specialized decoder is, where the engine says (the local
    engine on a CPU runs a reference implementation whose timings say nothing about the fused
    kernels, and the report must not let them pass for those)."""
    impl = _manifest_value(comparison, "decoder_impl")
    if impl == "None":
        return ""
    note = f"; specialized decoder implementation {impl}"
    if impl == "cpu-torch":
        note += " (a CPU reference of the fused decoder's math: its timings are not the kernels')"
    limit = _manifest_value(comparison, "specialized_max_tokens")
    if limit != "None":  # per-shape dispatch: wider steps ran the standard path
        note += f", serving steps of up to {limit} padded tokens"
        source = _manifest_value(comparison, "specialized_max_tokens_source")
        if source in _LIMIT_SOURCES:
            note += f" ({_LIMIT_SOURCES[source]})"
    return note


def _label_note(comparison: Comparison) -> list[str]:
    """A line when an arm's decode backend is only what the experiment declares: the server
    did not say what it runs (vLLM in attach mode), so a swapped URL would go unnoticed."""
    runs = comparison.runs_a + comparison.runs_b
    if any(s.run.manifest.get("decode_backend_source") == "declared" for s in runs):
        return [
            "- Arm labels are **declared**, not observed: the servers do not report their "
            "decode backend, so the report cannot check that each arm runs what it is called."
        ]
    return []


def setup_lines(comparison: Comparison, header: Sequence[str] = ()) -> list[str]:
    """What was compared: arms, runs, GPUs, engine, workload, replay window, bootstrap."""
    first = comparison.runs_a[0].run.manifest if comparison.runs_a else {}
    replay = first.get("replay")
    if not isinstance(replay, dict):
        replay = {}
    gpus = _manifest_value(comparison, "gpu_count")
    lines = [
        f"- Arms: **A = {comparison.arm_a}** ({len(comparison.runs_a)} run(s)), "
        f"**B = {comparison.arm_b}** ({len(comparison.runs_b)} run(s)); ratios are B/A.",
        f"- GPUs: {gpus} x {_manifest_value(comparison, 'gpu_name')} in both arms, "
        f"TP {_manifest_value(comparison, 'tp')}; model {_manifest_value(comparison, 'model')}; "
        f"engine {_manifest_value(comparison, 'engine')}" + _decoder_note(comparison) + ".",
        *_label_note(comparison),
        f"- Workload {str(_manifest_value(comparison, 'workload_hash'))[:12]}; "
        f"{comparison.sessions} sessions played; replay concurrency "
        f"{replay.get('concurrency', '?')}, profiling window "
        f"{replay.get('duration_s', '?')} s per run, warmup {replay.get('warmup_requests', '?')} "
        "requests per lane.",
        f"- Bootstrap: {comparison.resamples:,} paired session resamples, seed "
        f"{comparison.seed}, {100 * comparison.confidence:.0f}% CI.",
    ]
    lines.append(f"- {interval_method(comparison)}")
    if comparison.slo is not None:
        lines.append(
            f"- Service-level objectives: {comparison.slo.describe()} per request; goodput counts "
            "the successful requests that met all of them (per second of the profiling window)."
        )
    if comparison.matching is not None:
        lines.append(f"- Paired design: {comparison.matching.describe()}.")
    few = _few_repeats_line(comparison)
    if few:
        lines.append(f"- {few}")
    manifests = [s.run.manifest for s in comparison.runs_a + comparison.runs_b]
    drained = _drain_line(manifests)
    if drained:
        lines.append(f"- {drained}")
    lines += [f"- {line}" for line in simulator_caveats(manifests)]
    lines += [f"- {line}" for line in synthetic_acceptance_caveats(manifests)]
    lines += [f"- {line}" for line in header]
    for note in comparison.notes:
        lines.append(f"- Not compared (differs by design): {note.describe()}.")
    return lines


def _few_repeats_line(comparison: Comparison) -> str:
    """Why the intervals are wide when the repeats are two ('' otherwise): a t interval over
    two repeat ratios has one degree of freedom."""
    if comparison.repeat_pairing != "paired" or len(comparison.runs_a) != 2:
        return ""
    level = 0.5 + comparison.confidence / 2
    one, two, four = (t_quantile(level, df) for df in (1, 2, 4))
    return (
        f"Two repeats per arm: the interval over the repeats has 1 degree of freedom (t quantile "
        f"{one:.1f}, against {two:.1f} with three repeats and {four:.1f} with five), so it is "
        "wide whatever the runs show; run more repeats for a usable one."
    )


def _drain_line(manifests: Sequence[dict[str, Any]]) -> str:
    """How many requests the drain cap cut, over the compared runs ('' when none)."""
    runs = cut = 0
    for m in manifests:
        stats = m.get("stats")
        if isinstance(stats, dict) and str(stats.get("message", "")).startswith("drain cap:"):
            runs += 1
            cut += int(stats.get("cancelled") or 0)
    if not runs:
        return ""
    return (
        f"Drain cap: {cut} request(s) in {runs} run(s) were still in flight when their run's "
        "drain cap passed and were cut (recorded as cancelled, in no metric)."
    )


def interval_method(comparison: Comparison) -> str:
    """How the intervals were made, in one sentence (the same words in every report)."""
    margin = f"{100 * comparison.equivalence_margin:g}%"
    if comparison.repeat_pairing == "none":
        return (
            "**One run per arm**: run-to-run noise is not measured, so there is no interval "
            "and no verdict (the session bootstrap's spread is in comparison.json as "
            "`ci_sessions`); use `repeats >= 3`."
        )
    if comparison.repeat_pairing == "paired":
        return (
            "Interval: paired t interval over the repeats' B/A, never narrower than the paired "
            "session bootstrap over both arms and every repeat; 'equivalent' = the interval lies "
            f"within +-{margin}; 'could detect' = the smallest change found with 80% power."
        )
    return (
        "Interval: envelope of the session bootstrap and a Welch t interval over the runs "
        "(the runs did not replay one plan in pairs); 'equivalent' = within "
        f"+-{margin}; 'could detect' = the smallest change found with 80% power."
    )


def detectable_text(result: MetricResult) -> str:
    """'could detect +-X%' for one metric ('–' without an interval)."""
    if result.detectable is None:
        return "–"
    return f"+-{100 * result.detectable:.1f}%"


def verdict_text(comparison: Comparison, result: MetricResult) -> str:
    """The verdict, why it is withheld when it is, and the sample it rests on."""
    said = f"**{result.verdict}**"
    if result.verdict == EQUIVALENT:
        said += f" (no difference larger than +-{100 * comparison.equivalence_margin:g}%)"
    if comparison.withheld and result.verdict == WITHHELD:
        said += ": " + "; ".join(comparison.withheld)
    elif result.verdict == WITHHELD and comparison.repeat_pairing == "none":
        said += ": one run per arm; use repeats >= 3"
    if result.detectable is not None:
        said += f"; this comparison could detect a change of {detectable_text(result)} (80% power)"
    return f"{said} (A: {comparison.size_a.describe()}; B: {comparison.size_b.describe()})"


def headline_line(comparison: Comparison) -> str:
    result = comparison.metrics["p90_interactivity_tok_s"]
    unit = result.metric.unit
    return (
        f"**P90 interactivity = 1/P90(ITL)** (InferenceX definition): {comparison.arm_a} "
        f"{fmt(result.a, unit)} -> {comparison.arm_b} {fmt(result.b, unit)} {unit}, "
        f"B/A = {_ratio(result.ratio)} (95% CI {_ratio(result.ci_low)} – "
        f"{_ratio(result.ci_high)}): {verdict_text(comparison, result)}."
    )


def table_metrics(comparison: Comparison, names: Sequence[str] = TABLE_METRICS) -> list[str]:
    """The rows a report prints: `names`, then goodput when the comparison has objectives."""
    return [*names, *(m.name for m in GOODPUT if m.name in comparison.metrics)]


def metric_rows(comparison: Comparison, names: Sequence[str] = TABLE_METRICS) -> list[list[str]]:
    """Table cells per metric: label, better-when, A, B, ratio, CI, verdict, run spreads (and
    the goodput rows when the comparison has objectives)."""
    rows = []
    for name in table_metrics(comparison, names):
        r = comparison.metrics[name]
        unit = r.metric.unit
        rows.append(
            [
                f"{r.metric.label}" + (f" ({unit})" if unit and not unit.startswith("s") else ""),
                "higher" if r.metric.higher_is_better else "lower",
                fmt(r.a, unit),
                fmt(r.b, unit),
                _ratio(r.ratio),
                "–" if r.ci_low is None else f"{_ratio(r.ci_low)} – {_ratio(r.ci_high)}",
                r.verdict,
                detectable_text(r),
                f"{r.n_a:,} / {r.n_b:,}",
                _spread(r.runs_a, unit),
                _spread(r.runs_b, unit),
                _ratio_spread(r.pair_ratios),
            ]
        )
    return rows


TABLE_HEADER = [
    "metric",
    "better when",
    "A",
    "B",
    "B/A",
    "95% CI",
    "verdict",
    "could detect",
    "n (A / B)",
    "A per run",
    "B per run",
    "B/A per repeat",
]


BREAKDOWN_HEADER = [
    "requests (A / B)",
    "ITL p50 A",
    "B",
    "B/A",
    "P90 interactivity A (tok/s/user)",
    "B",
    "B/A",
    "TTFT p50 A",
    "B",
    "B/A",
]


def breakdown_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Table cells of one breakdown (agentab.analysis.breakdown): bucket, counts, figures."""
    out = []
    for r in rows:
        cells = [r["bucket"], f"{r['requests_a']:,} / {r['requests_b']:,}"]
        for fig, unit in (
            ("itl_p50_s", "s"),
            ("p90_interactivity_tok_s", "tok/s/user"),
            ("ttft_p50_s", "s"),
        ):
            cells += [fmt(r[f"{fig}_a"], unit), fmt(r[f"{fig}_b"], unit), _ratio(r[f"{fig}_ratio"])]
        out.append(cells)
    return out


def breakdown_sections(comparison: Comparison) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of each breakdown the comparison has."""
    sections = []
    for name, rows in comparison.breakdowns.items():
        if not rows:
            continue
        _, what, _ = BREAKDOWNS[name]
        title = (
            f"By {what}: point estimates per bucket over the requests the latency metrics "
            "compare (no interval or verdict per bucket: each holds a part of the sample)"
        )
        sections.append((title, [what, *BREAKDOWN_HEADER], breakdown_rows(rows)))
    return sections


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def server_rows(comparison: Comparison) -> list[list[str]]:
    """Scraped server-side figures per arm (not bootstrapped: one counter pair per run)."""
    rows = []
    for key, label in (
        ("spec_acceptance_length", "spec-decode acceptance length (server)"),
        ("server_cache_hit_ratio", "prefix-cache hit ratio (server)"),
        ("specialized_decode_share", "decode steps on the specialized path (server)"),
        ("decode_step_device_s", "pure-decode step, device time (server)"),
        ("draft_step_device_s", "drafter, device time per step that drafted (server)"),
        ("prefill_device_share", "device time in prefill and mixed steps (server)"),
        ("decode_idle_share", "device idle before decode steps, per decode busy time (server)"),
    ):
        a = [s.values.get(key) for s in comparison.runs_a]
        b = [s.values.get(key) for s in comparison.runs_b]
        if any(v is not None for v in a + b):
            unit = {"spec_acceptance_length": "x", "decode_step_device_s": "s",
                    "draft_step_device_s": "s"}.get(key, "")  # fmt: skip
            rows.append([label, _spread(a, unit), _spread(b, unit)])
    rates = [[s.values.get("spec_acceptance_rates") for s in side]
             for side in (comparison.runs_a, comparison.runs_b)]  # fmt: skip
    if any(r for side in rates for r in side):
        label = "spec-decode acceptance per draft position (server; synthetic_acceptance_rates)"
        rows.append([label, *(_rates(side) for side in rates)])
    return rows


def _rates(runs: Sequence[list[float] | None]) -> str:
    """Per-position rates of each run, `[0.91, 0.78, ...]`, runs separated by `; `."""
    shown = ["[" + ", ".join(f"{p:.3f}" for p in r) + "]" for r in runs if r]
    return "; ".join(shown) if shown else "–"


def comparison_markdown(
    comparison: Comparison, *, title: str | None = None, header: Sequence[str] = ()
) -> str:
    """The full A/B report (first line: CONFOUNDED when it is, else the title)."""
    lines: list[str] = []
    if comparison.incomplete:
        lines += [incomplete_line(comparison.incomplete), ""]
    if comparison.confounded_by:
        lines += [confounded_line(comparison.differences), ""]
    lines += [
        f"# A/B report: {title or f'{comparison.arm_a} vs {comparison.arm_b}'}",
        "",
        *setup_lines(comparison, header),
        "",
        headline_line(comparison),
        "",
        *markdown_table(TABLE_HEADER, metric_rows(comparison)),
    ]
    server = server_rows(comparison)
    if server:
        lines += ["", *markdown_table(["server metric", "A per run", "B per run"], server)]
    for title, head, rows in breakdown_sections(comparison):
        lines += ["", f"{title}:", "", *markdown_table(head, rows)]
    faults = fault_rows(comparison.runs_a, comparison.runs_b)
    lines += ["", FAULTS_TITLE, ""]
    lines += markdown_table(FAULT_HEADER, faults) if faults else ["None."]
    lines += ["", "Definitions:", *DEFINITIONS]
    if comparison.slo is not None:
        lines.append(GOODPUT_DEFINITION)
    return "\n".join(lines) + "\n"


def status_text(manifest: dict[str, Any]) -> str:
    """The run's status and why it stopped, as its manifest recorded them."""
    stats = manifest.get("stats")
    if not isinstance(stats, dict):
        stats = {}
    text = str(manifest.get("status", "unknown"))
    if stats.get("stop_reason"):
        text += f", stopped by {stats['stop_reason']}"
    if stats.get("message"):
        text += f": {' '.join(str(stats['message']).split())}"
    return text


def run_markdown(summary: RunSummary) -> str:
    """One run's summary (first line: INCOMPLETE when it is), the distributions table, then the
    scalar figures."""
    v = summary.values
    m = summary.run.manifest
    unfinished = describe_status(m)
    lines = [incomplete_line([f"{summary.run.path} ({unfinished})"]), ""] if unfinished else []
    lines += [
        f"# Run {summary.run.path} ({summary.run.arm})",
        "",
        f"- {m.get('gpu_count', '?')} x {m.get('gpu_name', '?')} GPUs, TP {m.get('tp', '?')}, "
        f"decode_backend {m.get('decode_backend', '?')}, engine {m.get('engine', '?')}.",
        *(f"- {line}" for line in simulator_caveats([m])),
        *(f"- {line}" for line in synthetic_acceptance_caveats([m])),
        f"- Requests (profiling): {v['requests']} ({v['requests_ok']} ok, {v['requests_error']} "
        f"errors = {fmt(v['error_rate'])}); warmup {v['requests_warmup']}; sessions "
        f"{v['sessions']}; errors by class: {v['errors_by_class'] or 'none'}; warnings by class: "
        f"{v.get('warnings_by_class') or 'none'}.",
        f"- Status: {status_text(m)}.",
        *(
            [f"- Warmup errors by class: {v['warmup_errors_by_class']}."]
            if v.get("warmup_errors_by_class")
            else []
        ),
        *(f"- First `{cls}` error: {msg}" for cls, msg in (v.get("error_examples") or {}).items()),
        "",
        f"**P90 interactivity = 1/P90(ITL)** (InferenceX, headline): "
        f"{fmt(v['p90_interactivity_tok_s'], 'tok/s/user')} tok/s/user.",
        "",
    ]
    units = {"osl_tokens": "tok", "prompt_tokens": "tok", "cached_tokens": "tok"}
    rows = []
    unmeasured = []
    for key in (*DISTRIBUTIONS, "dispatch_lateness_s"):  # units: time in ms/s, else as named
        stats = v.get(key) or {}
        if all(stats.get(k) is None for k in STAT_KEYS):
            unmeasured.append(key)  # e.g. TTFO when the server does not mark reasoning chunks
            continue
        unit = units.get(key, "tok/s/user" if key == "interactivity_tok_s" else "s")
        label = (
            "interactivity 1/ITL_i (AIPerf def.; not the headline)"
            if key == "interactivity_tok_s"
            else key
        )
        rows.append([label, *(fmt(stats.get(s), unit) for s in (*STAT_KEYS, *SPREAD_KEYS))])
    lines += markdown_table(["metric", *STAT_KEYS, *SPREAD_KEYS], rows)
    if unmeasured:
        lines += ["", f"Not measured in this run: {', '.join(unmeasured)}."]
    scalars = [
        ("decode throughput (prefill excluded), tok/s", v["decode_throughput_tok_s"], "tok/s"),
        ("output throughput, tok/s", v["output_throughput_tok_s"], "tok/s"),
        ("request throughput (successful), req/s", v.get("request_throughput_req_s"), "tok"),
        (
            "throughput per GPU (input incl. cached + output), tok/s/GPU",
            v["throughput_per_gpu_tok_s"],
            "tok",
        ),
        (
            "throughput per GPU (uncached input + output), tok/s/GPU",
            v.get("throughput_per_gpu_uncached_tok_s"),
            "tok",
        ),
        ("cache hit ratio (client: cached / prompt tokens)", v["cache_hit_ratio"], ""),
        ("cache hit ratio (server, scraped)", v.get("server_cache_hit_ratio"), ""),
        ("spec-decode acceptance length (server, scraped)", v.get("spec_acceptance_length"), "x"),
        ("profiling wall time", v["phase_wall_s"], "s"),
    ]
    lines += ["", *markdown_table(["figure", "value"], [[k, fmt(x, u)] for k, x, u in scalars])]
    return "\n".join(lines) + "\n"
