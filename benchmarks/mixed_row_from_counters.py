"""The cost per decode row of a mixed step that a recorded A/B's own step counters imply.

A recorded A/B of the local engine on a GPU scrapes the engine's step counters: how many steps
carried prefill tokens and how long the device spent on them (agentab:device_busy_seconds_total
less agentab:decode_device_busy_seconds_total). Simulating every run's recorded plan with a
profile gives the same steps priced, and the decode rows they carried. Setting the profile's
`[prefill] mixed_decode_row_us` to its value plus (measured - simulated) / decode rows per
such step, and simulating again, settles in a few rounds on the term at which the simulated
runs' prefill and mixed steps take, pooled over every run, what the engine measured. It
charges the decode rows with everything the prefill terms miss, so it is a trial value; a
calibration with a mixed phase (`agentab calibrate`) fits the term itself.

    python benchmarks/mixed_row_from_counters.py AB_DIR --profile P.toml [--rounds 3]
        [--async-scheduling] [--write OUT.toml]

Prints one line per run and round (measured vs simulated steps with prefill tokens, their mean
time, prefill tokens and decode rows per step) and the term of each round; --write keeps the
profile with the last term (and --async-scheduling) under OUT.toml.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentab.errors import AgentabError  # noqa: E402

BUSY = "agentab:device_busy_seconds_total"
DECODE_BUSY = "agentab:decode_device_busy_seconds_total"
PREFILL_TOKENS = "agentab:prefill_tokens_computed_total"


@dataclass
class PrefillSteps:
    """Steps that carried prefill tokens (prefill alone or mixed) over one run."""

    steps: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0
    decode_rows: int = 0  # simulated only: the counters do not split decode rows by step kind

    def line(self) -> str:
        n = max(self.steps, 1)
        rows = f", {self.decode_rows / n:.1f} decode rows" if self.decode_rows else ""
        return (
            f"{self.steps} steps of {self.seconds / n * 1e3:.1f} ms, "
            f"{self.prefill_tokens / n:.0f} prefill tokens{rows}"
        )


def measured(run: Path) -> PrefillSteps:
    """From the run's scraped counters, first scrape to last (the warmup included)."""
    from agentab.rundir import scan_metrics

    frame = scan_metrics(run).collect().sort("t_s")
    ends = frame.group_by("name").agg(pl.col("value").first().alias("a"), pl.col("value").last())
    delta = {r["name"]: r["value"] - r["a"] for r in ends.iter_rows(named=True)}
    if BUSY not in delta or DECODE_BUSY not in delta:
        raise AgentabError(f"{run}: no {BUSY} in its scraped metrics (the local engine on a GPU)")
    steps = sum(delta.get(f"agentab:steps_{p}_total", 0.0) for p in ("standard", "specialized"))
    decode = sum(
        delta.get(f"agentab:decode_steps_{p}_total", 0.0) for p in ("standard", "specialized")
    )
    return PrefillSteps(
        steps=int(steps - decode),
        seconds=delta[BUSY] - delta[DECODE_BUSY],
        prefill_tokens=int(delta.get(PREFILL_TOKENS, 0.0)),
    )


def simulated(profile: Path, run: Path, manifest: dict[str, Any], limits: dict, workload: Any):
    """The run's recorded plan on the simulator, its steps with prefill tokens observed."""
    from agentab.engine import build_simulator
    from agentab.replay.api import run_to_dir
    from agentab.replay.options import ReplayOptions
    from agentab.replay.targets.engine import EngineTarget

    engine = build_simulator(
        profile,
        str(manifest.get("decode_backend")),
        **limits,
        seed=int(manifest.get("engine_seed") or 0),
    )
    out = PrefillSteps()

    def observe(step: dict[str, Any]) -> None:
        if step["num_prefill_tokens"]:
            out.steps += 1
            out.seconds += step["duration_s"]
            out.prefill_tokens += step["num_prefill_tokens"]
            out.decode_rows += step["num_decode_tokens"]

    engine.step_observer = observe
    replay = ReplayOptions.from_mapping(manifest.get("replay") or {}, where=f"{run}: replay")
    with tempfile.TemporaryDirectory(prefix="agentab-mixed-") as tmp:
        run_to_dir(
            workload,
            EngineTarget(engine),
            replay=replay,
            out_dir=Path(tmp) / "run",
            virtual=True,
            progress=False,
        )
    return out


ASYNC_NOTE = "[E] the local engine schedules one step ahead on a GPU (the runs' device: cuda)"


def with_terms(text: str, mixed_row_us: float, async_scheduling: bool | None, note: str) -> str:
    """The profile's text with `[prefill] mixed_decode_row_us` (and async scheduling) set."""
    line = f"mixed_decode_row_us = {mixed_row_us:.1f}  # {note}"
    text, n = re.subn(r"(?m)^mixed_decode_row_us = .*$", line, text)
    if not n:
        text, n = re.subn(r"(?m)^\[prefill\]$", "[prefill]\n" + line, text)
        if not n:
            raise AgentabError("the profile has no [prefill] table")
    if async_scheduling is not None:
        value = f"async_scheduling = {'true' if async_scheduling else 'false'}  # {ASYNC_NOTE}"
        text, n = re.subn(r"(?m)^async_scheduling = .*$", value, text)
        if not n:
            text = text.rstrip("\n") + f"\n\n[engine]\n{value}\n"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ab_dir", type=Path, help="An `agentab ab` experiment dir of the local engine.")
    ap.add_argument("--profile", type=Path, required=True, help="Profile to start from.")
    ap.add_argument("--rounds", type=int, default=3, help="Simulations of every run.")
    ap.add_argument("--async-scheduling", action="store_true", help="Simulate with it on.")
    ap.add_argument("--write", type=Path, help="Write the profile with the last term here.")
    args = ap.parse_args()

    from agentab.calibrate.fidelity import simulator_options
    from agentab.calibrate.recorded import recorded_runs
    from agentab.calibrate.write import read_report
    from agentab.engine.profile import load_profile
    from agentab.experiments.ab import load_workload
    from agentab.experiments.experiment import load_experiment
    from agentab.experiments.experiment_dir import COPY

    experiment = load_experiment(args.ab_dir / COPY)
    runs = [r for _arm, arm_runs in recorded_runs(args.ab_dir, experiment) for r in arm_runs]
    workload = load_workload(experiment)
    limits = simulator_options(args.profile, read_report(args.profile), {})
    del limits["profile"]
    base = args.profile.read_text()
    term = load_profile(args.profile).mixed_decode_row_us
    truth = {run: measured(run) for run, _ in runs}
    m_steps = sum(t.steps for t in truth.values())
    m_mean = sum(t.seconds for t in truth.values()) / m_steps
    note = f"[A] trial: from the step counters of {args.ab_dir.name} (mixed_row_from_counters.py)"
    ahead = True if args.async_scheduling else None
    with tempfile.TemporaryDirectory(prefix="agentab-mixed-") as tmp:
        for round_no in range(args.rounds):
            profile = Path(tmp) / f"round-{round_no}.toml"
            profile.write_text(with_terms(base, term, ahead, note))
            sims = {run: simulated(profile, run, man, limits, workload) for run, man in runs}
            for run, _ in runs:
                label = f"{run.parent.name}/{run.name}"
                print(f"round {round_no} {label:<28} measured {truth[run].line()}")
                print(f"round {round_no} {'':<28} simulated {sims[run].line()}")
            s_steps = sum(s.steps for s in sims.values())
            s_mean = sum(s.seconds for s in sims.values()) / s_steps
            rows = sum(s.decode_rows for s in sims.values()) / s_steps
            new = max(term + (m_mean - s_mean) / rows * 1e6, 0.0)
            print(
                f"round {round_no}: mixed_decode_row_us {term:.1f}: steps with prefill tokens "
                f"{m_steps} measured, {m_mean * 1e3:.1f} ms each; {s_steps} simulated, "
                f"{s_mean * 1e3:.1f} ms each, {rows:.2f} decode rows each -> {new:.1f}",
                flush=True,
            )
            term = new
    if args.write:
        text = with_terms(base, term, ahead, note)
        name = f'name = "{args.write.stem}"  # a trial of {load_profile(args.profile).name}'
        head = (
            f"# TRIAL profile: {args.profile.name} with [prefill] mixed_decode_row_us set\n"
            f"# from the step counters of {args.ab_dir.name} (mixed_row_from_counters.py)"
            + (" and async scheduling on" if args.async_scheduling else "")
            + ".\n"
        )
        args.write.write_text(head + re.sub(r"(?m)^name = .*$", name, text, count=1))
        load_profile(args.write)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
