"""`fidelity`: one held-out workload on the real engine and on the simulator, side by side.

Both runs use the same workload, replay options and seed, so the plan (which requests, in
which lanes, at which planned times) is identical; the simulator copies the engine's
scheduler limits and KV block size from the calibration report, so only the step prices
differ. Relative error is simulated / measured - 1. With a second server running the other
decode backend (an A/B), the predicted B/A ratio of P90 interactivity is set against the
measured one: the number an A/B verdict rests on. When the server exports per-request
latency histograms (agentab's server does), each arm also gets a TTFT breakdown: the server's
intake, queue, prefill and output beside the client's and the simulator's TTFT
(agentab.calibrate.breakdown).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from agentab.errors import AgentabError
from agentab.replay.options import ReplayOptions
from agentab.workloads.model import Workload

# (label, summary key, statistic or None for a scalar)
METRICS: tuple[tuple[str, str, str | None], ...] = (
    ("ITL P50 (ms)", "itl_s", "p50"),
    ("ITL P90 (ms)", "itl_s", "p90"),
    ("ITL P99 (ms)", "itl_s", "p99"),
    ("TTFT P50 (ms)", "ttft_s", "p50"),
    ("TTFT P90 (ms)", "ttft_s", "p90"),
    ("TTFT P99 (ms)", "ttft_s", "p99"),
    ("E2E P50 (ms)", "e2e_s", "p50"),
    ("E2E P90 (ms)", "e2e_s", "p90"),
    ("E2E P99 (ms)", "e2e_s", "p99"),
    ("decode throughput (tok/s)", "decode_throughput_tok_s", None),
    ("P90 interactivity (tok/s)", "p90_interactivity_tok_s", None),
    ("cache hit ratio", "cache_hit_ratio", None),
)
_MS = {"itl_s", "ttft_s", "e2e_s"}


@dataclass(frozen=True)
class Arm:
    label: str  # "A" or "B"
    url: str
    decode_backend: str


def simulator_options(
    profile: Path, report: dict[str, Any] | None, overrides: dict[str, int | None]
) -> dict[str, Any]:
    """The simulator's engine options: the engine's limits from the report, flags first."""
    sched = (report or {}).get("scheduler") or {}
    opts: dict[str, Any] = {"profile": str(profile)}
    for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_blocks"):
        value = overrides.get(key)
        if value is None:
            value = sched.get(key)
        if value is None:
            raise AgentabError(
                f"--{key.replace('_', '-')}: the engine's value is not in "
                f"{profile.with_suffix('.fit.json')}; pass it"
            )
        opts[key] = int(value)
    return opts


def run_fidelity(
    workload: Workload,
    *,
    arms: list[Arm],
    engine_options: dict[str, Any],
    replay: ReplayOptions,
    out_dir: Path,
    model: str | None,
    progress: bool,
    profile_report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Replay on each server and on the simulator; the comparison as a JSON-able dict.
    `profile_report`: the profile's fit report (its provenance names the engine calibrated)."""
    from agentab.analysis.load import load_run
    from agentab.analysis.summary import summarize_run
    from agentab.calibrate.breakdown import read_histograms, ttft_breakdown
    from agentab.replay.api import replay_to_dir, simulate_to_dir
    from agentab.rundir import read_manifest

    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "workload": {"source": workload.source, "content_hash": workload.content_hash},
        "replay": replay.to_dict(),
        "engine_options": engine_options,
        "arms": {},
    }
    for arm in arms:
        suffix = "" if arm.label == "A" else "-b"
        before = read_histograms(arm.url)
        measured_dir = replay_to_dir(
            workload,
            url=arm.url,
            replay=replay,
            out_dir=out_dir / f"measured{suffix}",
            model=model,
            manifest_extra={"arm": f"measured{suffix}"},
            progress=progress,
        )
        after = read_histograms(arm.url) if before is not None else None
        simulated_dir = simulate_to_dir(
            workload,
            engine_options={**engine_options, "decode_backend": arm.decode_backend},
            replay=replay,
            out_dir=out_dir / f"simulated{suffix}",
            manifest_extra={"arm": f"simulated{suffix}"},
            progress=progress,
        )
        measured = summarize_run(load_run(measured_dir)).values
        simulated = summarize_run(load_run(simulated_dir)).values
        result["arms"][arm.label] = {
            "url": arm.url,
            "decode_backend": arm.decode_backend,
            "measured_dir": str(measured_dir),
            "simulated_dir": str(simulated_dir),
            "requests": {
                "measured": measured["requests_ok"],
                "simulated": simulated["requests_ok"],
            },
            "metrics": compare(measured, simulated),
        }
        breakdown = ttft_breakdown(before, after, measured_dir, simulated_dir)
        if breakdown is not None:
            result["arms"][arm.label]["ttft_breakdown"] = breakdown
    manifests = [read_manifest(Path(a["measured_dir"])) for a in result["arms"].values()]
    result["engine_source"] = engine_sources(profile_report, manifests)
    if len(arms) == 2:
        result["ab"] = ab_ratio(result["arms"])
    return result


def engine_sources(
    report: dict[str, Any] | None, manifests: list[dict[str, Any]]
) -> dict[str, Any]:
    """The engine code the profile was calibrated on beside what the measured runs ran.

    agentab's engines record a digest of their code (agentab.engine.source) in /agentab/describe,
    the calibration report and every run's manifest; a profile of another engine version may
    still predict well, but its errors then include that change, so the table says so."""
    provenance = (report or {}).get("provenance") or {}
    measured = sorted({str(m["engine_source"]) for m in manifests if m.get("engine_source")})
    return {"profile": provenance.get("engine_source"), "measured": measured}


def engine_change_note(result: dict[str, Any]) -> str | None:
    """One line when the profile's engine source is known and a measured run ran another."""
    sources = result.get("engine_source") or {}
    profile, measured = sources.get("profile"), sources.get("measured") or []
    if not profile or not measured or measured == [profile]:
        return None
    return (
        f"note: the profile was calibrated on engine source {profile}; the measured runs ran "
        f"{', '.join(measured)}: the errors below include the change between them"
    )


def _pick(values: dict[str, Any], key: str, stat: str | None) -> float | None:
    v = values.get(key)
    if stat is not None:
        v = v.get(stat) if isinstance(v, dict) else None
    if v is None:
        return None
    return float(v) * (1e3 if key in _MS else 1.0)


def compare(measured: dict[str, Any], simulated: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, key, stat in METRICS:
        m, s = _pick(measured, key, stat), _pick(simulated, key, stat)
        err = s / m - 1 if m and s is not None else None
        rows.append({"metric": label, "measured": m, "simulated": s, "error": err})
    return rows


def ab_ratio(arms: dict[str, Any]) -> dict[str, Any]:
    """B/A of P90 interactivity, measured and predicted."""

    def value(label: str, side: str) -> float | None:
        rows = arms[label]["metrics"]
        return next(r[side] for r in rows if r["metric"].startswith("P90 interactivity"))

    ma, mb, sa, sb = (
        value("A", "measured"),
        value("B", "measured"),
        value("A", "simulated"),
        value("B", "simulated"),
    )
    measured = mb / ma if ma and mb else None
    predicted = sb / sa if sa and sb else None
    err = predicted / measured - 1 if measured and predicted else None
    return {"measured_ratio": measured, "predicted_ratio": predicted, "error": err}


def render_table(result: dict[str, Any]) -> str:
    """Markdown: one table per arm, then the A/B line."""
    lines: list[str] = []
    note = engine_change_note(result)
    if note:
        lines += [note, ""]
    for label, arm in result["arms"].items():
        n = arm["requests"]
        lines.append(
            f"arm {label} ({arm['decode_backend']}): {n['measured']} requests measured, "
            f"{n['simulated']} simulated"
        )
        lines.append("")
        lines.append("| metric | measured | simulated | error |")
        lines.append("|---|---:|---:|---:|")
        for r in arm["metrics"]:
            err = "n/a" if r["error"] is None else f"{r['error']:+.1%}"
            lines.append(
                f"| {r['metric']} | {_fmt(r['measured'])} | {_fmt(r['simulated'])} | {err} |"
            )
        lines.append("")
        if "ttft_breakdown" in arm:
            from agentab.calibrate.breakdown import render_breakdown

            lines.extend(render_breakdown(arm["ttft_breakdown"]))
            lines.append("")
    if "ab" in result:
        ab = result["ab"]
        err = "n/a" if ab["error"] is None else f"{ab['error']:+.1%}"
        lines.append(
            f"B/A P90 interactivity: measured {_fmt(ab['measured_ratio'])}, predicted "
            f"{_fmt(ab['predicted_ratio'])} (error {err})"
        )
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"


def write_result(out_dir: Path, result: dict[str, Any]) -> Path:
    path = out_dir / "fidelity.json"
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    (out_dir / "fidelity.md").write_text(render_table(result) + "\n")
    return path
