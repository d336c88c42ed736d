"""Fidelity against an A/B that already ran: simulate each recorded run's exact plan, then pool.

A GPU A/B is expensive, so it should serve twice: once as the measurement, once as the held-out
workload the simulator must predict. Every run dir of an `agentab ab` experiment dir records
what the simulator needs to play the same plan: the replay options (seed, salt, window,
concurrency) and the engine seed in its manifest, the workload in the dir's copy of the
experiment file. Each run is simulated with the calibrated profile and the engine's limits,
on the run's decode backend; then both sides are pooled over repeats the way `compare` pools an
arm (percentiles over all requests of all runs, throughputs as total tokens over total
seconds), so the errors are errors of the figures the A/B report prints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agentab.analysis.summary import RunSummary
from agentab.calibrate.fidelity import METRICS, ab_ratio, compare, engine_sources
from agentab.errors import AgentabError
from agentab.experiments.experiment import Experiment


def recorded_runs(
    ab_dir: Path, experiment: Experiment
) -> list[tuple[str, list[tuple[Path, dict[str, Any]]]]]:
    """Each arm (in the experiment's order) with its completed runs and their manifests, in
    repeat order, where `agentab ab` puts them."""
    from agentab.experiments.ab import arm_run_dir
    from agentab.experiments.experiment_dir import is_complete
    from agentab.rundir import read_manifest

    arms = []
    for arm in experiment.arms:
        done = [arm_run_dir(ab_dir, arm, k) for k in range(experiment.repeats)]
        done = [run for run in done if is_complete(run)]
        if not done:
            raise AgentabError(f"--ab {ab_dir}: no completed run of arm {arm.name!r}")
        arms.append((arm.name, [(run, read_manifest(run)) for run in done]))
    return arms


def predict_recorded(
    ab_dir: Path,
    *,
    engine_options: dict[str, Any],
    out_dir: Path,
    progress: bool,
    echo: Callable[[str], None] = lambda s: None,
    profile_report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Simulate every completed run of `ab_dir`; measured vs simulated per arm, pooled.
    `profile_report`: the profile's fit report (its provenance names the engine calibrated)."""
    from agentab.analysis.load import load_run
    from agentab.analysis.summary import summarize_run
    from agentab.experiments.ab import load_workload
    from agentab.experiments.experiment import load_experiment
    from agentab.experiments.experiment_dir import COPY
    from agentab.replay.api import simulate_to_dir
    from agentab.replay.options import ReplayOptions

    if not (ab_dir / COPY).is_file():
        raise AgentabError(f"--ab {ab_dir}: not an `agentab ab` experiment dir (no {COPY})")
    out_dir.mkdir(parents=True, exist_ok=True)
    experiment = load_experiment(ab_dir / COPY)
    runs = recorded_runs(ab_dir, experiment)
    workload = load_workload(experiment)
    result: dict[str, Any] = {
        "ab_dir": str(ab_dir),
        "experiment": experiment.name,
        "workload": {"source": workload.source, "content_hash": workload.content_hash},
        "engine_options": engine_options,
        "arms": {},
    }
    for label, (arm, arm_runs) in zip(("A", "B"), runs, strict=True):
        measured: list[RunSummary] = []
        simulated: list[RunSummary] = []
        backend = None
        spec: dict[str, Any] = {}
        for run, manifest in arm_runs:
            backend = str(manifest.get("decode_backend"))
            replay = ReplayOptions.from_mapping(
                manifest.get("replay") or {}, where=f"{run}/manifest.json: replay"
            )
            target = out_dir / "simulated" / arm / run.name
            spec = simulator_spec(run, manifest)
            echo(f"  simulating {arm} {run.name} ({backend}{describe_spec(spec)})")
            simulate_to_dir(
                workload,
                engine_options={
                    **engine_options,
                    **spec,
                    "decode_backend": backend,
                    "seed": int(manifest.get("engine_seed") or 0),
                },
                replay=replay,
                out_dir=target,
                manifest_extra={"arm": f"simulated-{arm}", "repeat": manifest.get("repeat")},
                progress=progress,
            )
            measured.append(summarize_run(load_run(run)))
            simulated.append(summarize_run(load_run(target)))
        m_values, s_values = pooled_values(measured), pooled_values(simulated)
        result["arms"][label] = {
            "arm": arm,
            "decode_backend": backend,
            "spec": spec or None,  # the arm's last run's (an arm runs one config)
            "runs": [str(run) for run, _ in arm_runs],
            "requests": {"measured": m_values["requests_ok"], "simulated": s_values["requests_ok"]},
            "metrics": compare(m_values, s_values),
            "per_run": [
                {
                    "run": str(run),
                    "metrics": compare(m.values, s.values),
                }
                for (run, _), m, s in zip(arm_runs, measured, simulated, strict=True)
            ],
        }
    result["engine_source"] = engine_sources(
        profile_report, [manifest for _, arm_runs in runs for _, manifest in arm_runs]
    )
    result["ab"] = ab_ratio(result["arms"])
    return result


def simulator_spec(run: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The simulator's speculative-decoding options for a recorded run: what the run's engine
    drafted, with the acceptance it ran at.

    Why the acceptance comes from where it does: a synthetic method's rates are the engine's
    own setting, so the simulator gets the same (the same length, or the same per-position
    rates, drawn by the same rule: agentab.engine.spec_decode); greedy verification's acceptance
    is whatever the drafter achieved on these prompts, so it is read off the run's own
    per-position counters (agentab.calibrate.acceptance), as `agentab acceptance` does. A run
    without speculative decoding gives no options."""
    spec = manifest.get("spec")
    if not spec:
        return {}
    if "num_draft_tokens" in spec:  # a simulated run: its own options, as recorded
        out: dict[str, Any] = {"num_draft_tokens": int(spec["num_draft_tokens"])}
        if spec.get("acceptance_length") is not None:
            out["acceptance_length"] = float(spec["acceptance_length"])
        else:
            out["acceptance_probs"] = tuple(float(p) for p in spec.get("acceptance_probs") or ())
        return out
    if "num_speculative_tokens" not in spec:
        raise AgentabError(
            f"{run}/manifest.json: spec {spec!r} names no num_speculative_tokens; "
            "cannot simulate its speculative decoding"
        )
    out = {"num_draft_tokens": int(spec["num_speculative_tokens"])}
    if spec.get("rejection_sample_method") == "synthetic":
        if spec.get("synthetic_acceptance_length") is not None:
            out["acceptance_length"] = float(spec["synthetic_acceptance_length"])
        else:
            out["acceptance_probs"] = tuple(float(p) for p in spec["synthetic_acceptance_rates"])
        return out
    from agentab.calibrate.acceptance import from_runs

    measured = from_runs(run)
    if measured.k != out["num_draft_tokens"]:
        raise AgentabError(
            f"{run}: {measured.k} draft positions counted, the manifest's spec drafts "
            f"{out['num_draft_tokens']}"
        )
    out["acceptance_probs"] = measured.rates
    return out


def describe_spec(spec: dict[str, Any]) -> str:
    """`, 7 drafts at acceptance length 6` (progress lines), or nothing without drafts."""
    if not spec:
        return ""
    if "acceptance_length" in spec:
        at = f"acceptance length {spec['acceptance_length']:g}"
    else:
        at = "per-position rates " + ", ".join(f"{p:.3f}" for p in spec["acceptance_probs"])
    return f", {spec['num_draft_tokens']} drafts at {at}"


def pooled_values(summaries: Sequence[RunSummary]) -> dict[str, Any]:
    """One arm's pooled point estimates, in the nested shape of a run's summary values."""
    from agentab.analysis.sample import build_sample, session_index

    sessions = session_index(summaries)
    sample = build_sample("pooled", summaries, sessions)
    flat = sample.evaluate(np.ones((1, sessions.height)))
    values: dict[str, Any] = {
        "requests_ok": int(sum(s.values.get("requests_ok") or 0 for s in summaries))
    }
    for _label, key, stat in METRICS:
        name = f"{key}.{stat}" if stat else key
        v = float(flat[name][0]) if name in flat else None
        v = None if v is None or not np.isfinite(v) else v
        if stat:
            values.setdefault(key, {})[stat] = v
        else:
            values[key] = v
    return values
