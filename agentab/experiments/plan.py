"""`agentab plan` and `ab --dry-run`: the repeats and windows an experiment needs, from runs.

The variances come from a paired pilot (agentab.analysis.power): an experiment dir that `ab`
wrote (earlier runs, or a short pilot stopped with `--max-runs`), each point of a sweep dir, or,
for a simulator experiment file, a pilot the simulator runs here in seconds with the engine
timing noise given (`--step-noise`, `--run-noise`; a real engine's figures come from an A/A:
benchmarks/engine_noise.py).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from agentab.analysis.compare import compare_runs
from agentab.analysis.load import load_run
from agentab.analysis.power import Pilot, PlanRow, plan
from agentab.engine.options import SimulatorOptions
from agentab.errors import AgentabError
from agentab.experiments.experiment import Experiment
from agentab.experiments.experiment_dir import COPY, is_complete

PILOT_REPEATS = 3


@dataclass(frozen=True)
class PointPlan:
    """The plan at one load point (`point` None: an A/B without a sweep)."""

    point: str | None
    pilot: Pilot
    rows: list[PlanRow]

    def to_json(self) -> dict[str, Any]:
        p = self.pilot
        return {
            "point": self.point,
            "pilot": {
                "repeats": p.repeats,
                "window_s": p.window_s,
                "observed_ratio": p.observed_ratio,
                "repeat_variance": p.repeat_variance,
                "run_variance": p.run_variance,
            },
            "plans": [r.to_json() for r in self.rows],
        }


def _arm_names(out_dir: Path) -> tuple[list[str], dict[str, Any] | None]:
    """The arms in file order, and the sweep table, from the dir's copy of the experiment."""
    copy = out_dir / COPY
    if not copy.is_file():
        raise AgentabError(f"{out_dir}: no {COPY}: not an experiment dir written by `agentab ab`")
    try:
        doc = tomllib.loads(copy.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise AgentabError(f"{copy}: {exc}") from None
    arms = [str(a.get("name") or a.get("decode_backend")) for a in doc.get("arms") or []]
    if len(arms) != 2:
        raise AgentabError(f"{copy}: expected two [[arms]]")
    return arms, doc.get("sweep")


def _completed_runs(arm_dir: Path) -> list[Path]:
    return sorted(p for p in arm_dir.glob("run-*") if is_complete(p))


def pilots_from_dir(out_dir: Path, metric: str, resamples: int, seed: int) -> list[tuple]:
    """(point label or None, Pilot) for the A/B or for every point of a sweep in `out_dir`."""
    arms, sweep = _arm_names(out_dir)
    if sweep:
        points = sorted(
            (p for p in out_dir.iterdir() if p.is_dir() and (p / arms[0]).is_dir()),
            key=lambda p: float(p.name.rpartition("-")[2]),
        )
    else:
        points = [out_dir]
    out = []
    for point_dir in points:
        runs = [_completed_runs(point_dir / arm) for arm in arms]
        # repeats both arms completed, in repeat order
        both = sorted({p.name for p in runs[0]} & {p.name for p in runs[1]})
        if len(both) < 2:
            where = point_dir.name if sweep else str(out_dir)
            raise AgentabError(
                f"{where}: {len(both)} repeat(s) with both arms completed; a plan needs at "
                "least two (run `agentab ab` with --max-runs 4 for a pilot)"
            )
        comparison = compare_runs(
            [load_run(point_dir / arms[0] / n) for n in both],
            [load_run(point_dir / arms[1] / n) for n in both],
            resamples=resamples,
            seed=seed,
        )
        try:
            pilot = Pilot.from_comparison(comparison, metric)
        except ValueError as exc:
            raise AgentabError(f"{point_dir}: {exc}") from None
        out.append((point_dir.name if sweep else None, pilot))
    return out


def simulated_pilots(
    experiment: Experiment,
    metric: str,
    *,
    step_noise: float,
    run_noise: float,
    progress: bool = False,
) -> list[tuple]:
    """(point label or None, Pilot): the experiment on its simulator, with engine timing
    noise, PILOT_REPEATS repeats per arm at every point, in a temp dir."""
    from agentab.experiments.ab import run_experiment

    if experiment.engine_kind != "simulator":
        raise AgentabError(
            f"{experiment.path}: a pilot is simulated only for engine kind 'simulator'; for "
            f"{experiment.engine_kind!r}, run a short pilot with `agentab ab --max-runs 4` and "
            "give `agentab plan` its dir"
        )
    noise = {"step_noise": step_noise, "run_noise": run_noise}
    engine = {**experiment.engine, **noise}
    assert isinstance(experiment.engine_options, SimulatorOptions)
    engine_options = msgspec.structs.replace(experiment.engine_options, **noise)
    sweep = experiment.sweep
    points: list[tuple[str | None, dict[str, Any]]] = [(None, experiment.replay)]
    if sweep is not None:
        points = [(sweep.label(x), {**experiment.replay, sweep.variable: x}) for x in sweep.points]
    root = Path(tempfile.mkdtemp(prefix="agentab-plan-"))
    out = []
    try:
        for label, replay in points:
            pilot_experiment = dataclasses.replace(
                experiment,
                engine=engine,
                engine_options=engine_options,
                replay=replay,
                repeats=PILOT_REPEATS,
                sweep=None,
            )
            result = run_experiment(
                pilot_experiment, root / (label or "ab"), progress=progress, log=lambda _: None
            )
            assert result is not None  # no --max-runs: every run is done
            out.append((label, Pilot.from_comparison(result[0], metric)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def plan_points(
    pilots: list[tuple],
    effect: float,
    *,
    windows: list[float] | None,
    power: float,
    confidence: float,
) -> list[PointPlan]:
    return [
        PointPlan(
            label, pilot, plan(pilot, effect, windows=windows, power=power, confidence=confidence)
        )
        for label, pilot in pilots
    ]


def plan_text(plans: list[PointPlan], effect: float, power: float, metric_label: str) -> str:
    """The plan as a Markdown table per point."""
    lines = [
        f"# Plan: detect a change of {100 * effect:g}% in {metric_label} with "
        f"{100 * power:g}% power",
        "",
    ]
    for p in plans:
        pilot = p.pilot
        ratio = "–" if pilot.observed_ratio is None else f"{pilot.observed_ratio:.3f}"
        lines += [
            (f"## {p.point}" if p.point else "## A/B"),
            "",
            f"From {pilot.repeats} paired repeats of {pilot.window_s:g} s (B/A there {ratio}): "
            f"one repeat's sampling sd {100 * math.sqrt(pilot.repeat_variance):.2f}%, "
            f"run-level sd {100 * math.sqrt(pilot.run_variance):.2f}% (log scale).",
            "",
            "| window per run | repeats per arm | could detect | measured time per arm | "
            "limited by |",
            "|---|---|---|---|---|",
        ]
        for r in p.rows:
            if r.repeats is None:
                lines.append(f"| {r.window_s:g} s | out of reach | – | – | {r.limited_by} |")
                continue
            lines.append(
                f"| {r.window_s:g} s | {r.repeats} | +-{100 * r.detectable:.1f}% | "
                f"{r.arm_seconds:,.0f} s | {r.limited_by} |"
            )
        lines.append("")
    return "\n".join(lines)
