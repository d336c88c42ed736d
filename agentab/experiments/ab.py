"""`agentab ab`: run an experiment's two arms interleaved, then compare and report.

Order: ABBA blocks (repeat 1: A then B; repeat 2: B then A; ...; `run_order`), so slow drift
(thermal state, a noisy neighbour, cache warmth of the host) falls on both arms of a repeat
alike. Repeat k of both arms uses replay
seed `seed + k`: the two arms of a repeat see the same lane start points and salts, and repeats
differ from each other (with the deterministic simulator, identical repeats would add nothing).
One prompt salt is drawn per experiment dir (or read from `[replay] prompt_salt`) and shared by
every run, so running the experiment again against warm servers does not start on cached
prompts, while a resumed run gets the salt of the other arm of its repeat.

Running the same command on the same experiment dir runs only the runs that are missing (a dir
of another experiment is refused; `agentab.experiments.experiment_dir`), so a long A/B can be
completed in several sittings (`--max-runs`).

Layout of the experiment dir:
    experiment.toml      a copy of the file that was run
    <arm A>/run-1/ ...   one run dir per (arm, repeat), each with its summary.json
    <arm B>/run-1/ ...
    comparison.json      `compare --json` of the two arms
    report.md            the Markdown report (also printed)
    report.html          the same with plots (offline)
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson

from agentab.analysis.compare import Comparison, compare_runs
from agentab.analysis.html import write_html
from agentab.analysis.load import load_run
from agentab.analysis.markdown import comparison_markdown
from agentab.analysis.summary import summarize_run, write_summary
from agentab.engine.options import LocalLaunch, SimulatorOptions
from agentab.engine.vllm.args import VllmLaunch
from agentab.errors import AgentabError
from agentab.experiments.experiment import Arm, Experiment
from agentab.experiments.experiment_dir import (
    check_same_engine_code,
    check_same_window,
    clear_unfinished,
    experiment_salt,
    is_complete,
    is_fresh,
    prepare_dir,
)
from agentab.extras import require
from agentab.replay import replay_to_dir, simulate_to_dir

Log = Callable[[str], None]


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_workload(experiment: Experiment):  # -> agentab.workloads.Workload
    """The experiment's workload: a trace file, or the generator with the file's parameters."""
    spec = experiment.workload
    if "path" in spec:
        from agentab.workloads import load

        return load(spec["path"], spec["format"], freeze=True)  # lives for the whole A/B
    from agentab.workloads.generator import apply_overrides, generate, load_config

    gen = spec["generate"]
    config = load_config(gen["preset"])
    if gen["config"]:
        where = f"{experiment.path}: [workload.generate.config]"
        config = apply_overrides(config, gen["config"], where).validate()
    try:
        return generate(config, gen["sessions"], gen["seed"])
    except AgentabError as exc:
        raise AgentabError(f"{experiment.path}: [workload.generate]: {exc}") from None


def replay_options(
    experiment: Experiment,
    repeat: int,
    point: int | float | None = None,
    prompt_salt: str | None = None,
    window_s: float | None = None,
):  # -> ReplayOptions
    """Repeat k's replay options (seed + k in both arms); at a sweep point, with the swept
    option (`concurrency` or `rate`) set to the point; with `window_s` (a sequential block's
    length, `block_window`), that profiling window in place of the file's `duration_s`.

    `prompt_salt` is the invocation's salt (the file's `[replay] prompt_salt` when it sets
    one): both arms of a repeat get the same, so they send identical prompts, and the seed
    keeps the repeats apart. At a sweep point the point is appended, so runs of two points
    against one server do not share cached prompts either.
    """
    from agentab.replay.options import ReplayOptions

    swept = {experiment.sweep.variable: point} if experiment.sweep and point is not None else {}
    salt = experiment.replay.get("prompt_salt") or prompt_salt
    if salt is not None and experiment.sweep is not None and point is not None:
        salt = f"{salt}@{experiment.sweep.label(point)}"
    window = {"duration_s": window_s} if window_s is not None else {}
    return ReplayOptions.from_mapping(
        {
            **experiment.replay,
            **swept,
            **window,
            "seed": experiment.seed + repeat,
            "prompt_salt": salt,
        },
        where=f"{experiment.path}: [replay]",
    )


def block_window(experiment: Experiment, block_seconds: float | None) -> float | None:
    """The profiling window of one `--until-decided` block: `block_seconds`, else the file's.

    The sequence does not know the blocks' variance, so it pays in blocks (no verdict before
    three), not in seconds: shorter blocks reach a verdict on less traffic. A block longer than
    the file's window would make every block dearer than a fixed-design repeat, the opposite of
    the point, and is refused (a longer window belongs in `[replay] duration_s`). A file whose
    runs end on a request count (`lane_requests`) has no window to shorten.
    """
    replay = replay_options(experiment, 0)
    if block_seconds is None:
        return replay.duration_s
    if not (math.isfinite(block_seconds) and block_seconds > 0):
        raise AgentabError(f"--block-seconds {block_seconds}: must be a positive number")
    if replay.lane_requests is not None or replay.duration_s is None:
        raise AgentabError(
            f"--block-seconds: {experiment.path}: runs end after [replay] lane_requests "
            "requests per lane, not on a window; a block is one such run"
        )
    if block_seconds > replay.duration_s:
        raise AgentabError(
            f"--block-seconds {block_seconds:g}: longer than the file's window ([replay] "
            f"duration_s = {replay.duration_s:g}); blocks are meant to be shorter (a longer "
            "window belongs in the file)"
        )
    return block_seconds


def run_arm(
    experiment: Experiment,
    arm: Arm,
    repeat: int,
    workload: Any,
    run_dir: Path,
    *,
    progress: bool,
    point: int | float | None = None,
    prompt_salt: str | None = None,
    window_s: float | None = None,
    placement: dict[str, Any] | None = None,
) -> Path:
    """One run of one arm into `run_dir`, on the experiment's engine kind (at a sweep point,
    with the swept replay option set to it; with `window_s`, that profiling window).

    `placement`: where the run executes (`agentab.experiments.tasks.placement`), recorded in
    the manifest; by default this process."""
    from agentab.experiments.tasks import placement as this_process

    replay = replay_options(experiment, repeat, point, prompt_salt, window_s)
    extra: dict[str, Any] = {
        "arm": arm.name,
        "repeat": repeat,
        "experiment": experiment.name,
        "placement": placement if placement is not None else this_process("process"),
    }
    if experiment.sweep is not None and point is not None:
        extra["sweep_point"] = {experiment.sweep.variable: point}
    kind = experiment.engine_kind
    if kind == "simulator":
        options = simulator_options(experiment, arm, repeat)
        return simulate_to_dir(
            workload,
            engine_options=options,
            replay=replay,
            out_dir=run_dir,
            manifest_extra=extra,
            progress=progress,
        )
    model = experiment.engine.get("model")
    if kind == "http":
        # The client cannot see the server's GPUs: the experiment file states them.
        extra.update(
            decode_backend=arm.decode_backend,
            gpu_count=arm.gpu_count,
            gpu_ids=list(experiment.gpu_ids),
        )
        return replay_to_dir(
            workload,
            url=arm.url or "",
            replay=replay,
            out_dir=run_dir,
            model=model,
            api_key_env=experiment.engine.get("api_key_env"),
            manifest_extra=extra,
            progress=progress,
        )
    if kind == "local":
        return _run_local_arm(experiment, arm, replay, workload, run_dir, extra, progress=progress)
    return _run_vllm_arm(experiment, arm, replay, workload, run_dir, extra, progress=progress)


def _run_local_arm(
    experiment: Experiment,
    arm: Arm,
    replay: Any,
    workload: Any,
    run_dir: Path,
    extra: dict[str, Any],
    *,
    progress: bool,
) -> Path:
    """A local-engine arm: its own `agentab serve --engine local` process, stopped after the
    run; the server's own facts (/agentab/describe) go into the manifest."""
    from agentab.engine.local.launch import launched_local_server

    launch = experiment.engine_options
    assert isinstance(launch, LocalLaunch)  # decoded from [engine] when the file was loaded
    with launched_local_server(
        launch, decode_backend=arm.decode_backend, log_dir=run_dir
    ) as server:
        return replay_to_dir(
            workload,
            url=server.url,
            replay=replay,
            out_dir=run_dir,
            manifest_extra={"gpu_ids": list(experiment.gpu_ids), **extra},
            progress=progress,
        )


def _run_vllm_arm(
    experiment: Experiment,
    arm: Arm,
    replay: Any,
    workload: Any,
    run_dir: Path,
    extra: dict[str, Any],
    *,
    progress: bool,
) -> Path:
    """A vLLM arm: attach to the arm's URL, or launch its server on the experiment's GPUs.

    The server's facts (`server.manifest`) go into the run manifest, so the guard compares
    what both servers report (version, parallel and cache config, command line).
    """
    from agentab.engine.vllm import attached_server, launched_server

    api_key_env = experiment.engine.get("api_key_env")
    if arm.url is not None:
        assert isinstance(arm.url, str)  # a list of URLs is refused for vllm arms when parsed
        server_cm = attached_server(arm.url, int(arm.gpu_count or 0), api_key_env=api_key_env)
    else:
        gpus = list(experiment.gpu_ids) or experiment.gpu_count
        launch = experiment.engine_options
        assert isinstance(launch, VllmLaunch)  # decoded from [engine] when the file was loaded
        server_cm = launched_server(
            launch, decode_backend=arm.decode_backend, gpus=gpus, log_dir=run_dir
        )
    with server_cm as server:
        return replay_to_dir(
            workload,
            url=server.url,
            replay=replay,
            out_dir=run_dir,
            model=server.model or experiment.engine.get("model"),
            api_key_env=api_key_env,
            manifest_extra={**server.manifest, "decode_backend": arm.decode_backend, **extra},
            progress=progress,
        )


def simulator_options(experiment: Experiment, arm: Arm, repeat: int) -> SimulatorOptions:
    """The simulator of one run: the experiment's [engine], the arm's decode backend, the
    repeat's seed and, unless [engine] fixes it, a noise seed of the arm's own (each arm's
    engine draws its own timing noise, as two real servers would)."""
    options = experiment.engine_options
    assert isinstance(options, SimulatorOptions)
    seed = experiment.seed + repeat
    noise_seed = options.noise_seed
    if "noise_seed" not in experiment.engine and (options.step_noise or options.run_noise):
        noise_seed = 2 * seed + experiment.arms.index(arm)
    return msgspec.structs.replace(
        options, decode_backend=arm.decode_backend, seed=seed, noise_seed=noise_seed
    )


def check_before_running(experiment: Experiment, window_s: float | None = None) -> None:
    """Fail before any run on anything a later run would fail on: the replay options of every
    repeat (with `window_s`, a sequential block's window) and, on the simulator, the profile's
    GPU count and each arm's engine (its decode backend and spec-decode settings), so a bad arm
    B is not found after arm A has run."""
    points = experiment.sweep.points if experiment.sweep else (None,)
    for point in points:
        for repeat in range(experiment.repeats):
            replay_options(experiment, repeat, point, window_s=window_s)
    if experiment.engine_kind == "local":
        # each arm's server is this interpreter running `agentab serve --engine local`
        require("torch", f'{experiment.path}: [engine] kind "local" (the local torch engine)')
    if experiment.engine_kind != "simulator":
        return
    from agentab.engine.profile import load_profile
    from agentab.engine.sim import simulator_from

    profile = load_profile(experiment.engine["profile"])
    if profile.gpu_count != experiment.gpu_count:
        raise AgentabError(
            f"{experiment.path}: [gpus] count is {experiment.gpu_count} but simulator profile "
            f"{experiment.engine['profile']!r} models {profile.gpu_count} GPUs"
        )
    for arm in experiment.arms:
        try:
            simulator_from(simulator_options(experiment, arm, 0))
        except AgentabError as exc:
            raise AgentabError(f"{experiment.path}: arm {arm.name!r}: {exc}") from None


def run_order(experiment: Experiment, repeats: int) -> list[tuple[int, Arm]]:
    """(repeat, arm) in the order they run: A B, then B A, then A B, ... (ABBA blocks).

    Each repeat runs both arms back to back, so slow drift of the machine (thermal state, a
    neighbour) falls on both arms of a repeat nearly alike; alternating which arm goes first
    cancels a linear drift within the pair too, where A B A B would always favour one arm.
    """
    a, b = experiment.arms
    return [(k, arm) for k in range(repeats) for arm in ((a, b) if k % 2 == 0 else (b, a))]


def run_experiment(
    experiment: Experiment,
    out_dir: Path,
    *,
    progress: bool = False,
    log: Log = stderr_line,
    max_runs: int | None = None,
    until_decided: bool = False,
    max_repeats: int | None = None,
    block_seconds: float | None = None,
) -> tuple[Comparison, str] | None:
    """Run every missing (repeat, arm) in ABBA order, compare, write the reports; returns the
    comparison and its Markdown, or None when `max_runs` stopped it before every run was done
    (running it again on the same dir completes it).

    `until_decided`: repeat blocks run until the confidence sequence decides the headline
    (agentab.analysis.sequential), at most `max_repeats` (default 3 x the file's repeats), each
    block one run per arm of `block_seconds` (default the file's `duration_s`); the report then
    carries the sequential verdict, valid however early it stopped.
    """
    if block_seconds is not None and not until_decided:
        raise AgentabError("--block-seconds applies with --until-decided")
    window = block_window(experiment, block_seconds)
    check_before_running(experiment, window)
    # a fresh start runs everything: its workload is loaded (and a bad trace refused) before the
    # dir exists; a resume loads it only when a run is left to do
    workload = load_workload(experiment) if is_fresh(out_dir) else None
    resumed = prepare_dir(experiment, out_dir)
    started = time.monotonic()
    limit = experiment.repeats
    if until_decided:
        limit = max_repeats or 3 * experiment.repeats
    plan = run_order(experiment, limit)
    todo = [(k, arm) for k, arm in plan if not is_complete(arm_run_dir(out_dir, arm, k))]
    done_dirs = [d for d in (arm_run_dir(out_dir, arm, k) for k, arm in plan) if is_complete(d)]
    check_same_window(done_dirs, window)
    if todo:
        check_same_engine_code(experiment, done_dirs)
    what = (
        f"up to {_repeats(limit)} x 2 arms{_of_seconds(window)}, until decided"
        if until_decided
        else f"{_repeats(limit)} x 2 arms"
    )
    if todo and workload is None:
        workload = load_workload(experiment)
    if resumed:
        log(
            f"agentab ab: {experiment.name}: resuming {out_dir}: {len(plan) - len(todo)} of "
            f"{len(plan)} runs complete, {len(todo)} to run ({what})"
        )
    else:
        assert workload is not None  # a fresh dir: every run is to do
        log(
            f"agentab ab: {experiment.name}: {len(workload)} sessions, "
            f"{workload.num_requests()} requests; {what} -> {out_dir}"
        )
    salt = experiment_salt(out_dir)
    sequence = _Sequence(experiment, out_dir, window) if until_decided else None
    done = 0
    for repeat, arm in plan:
        run_dir = arm_run_dir(out_dir, arm, repeat)
        if is_complete(run_dir):
            if sequence is not None and sequence.add_if_block_done(repeat):
                break
            continue
        done += 1
        if max_runs is not None and done > max_runs:
            log(
                f"agentab ab: stopped after {max_runs} run(s) (--max-runs): "
                f"{len(plan) - len(todo) + max_runs} of {len(plan)} runs complete; run the "
                f"same command on {out_dir} to continue"
            )
            return None
        clear_unfinished(run_dir)
        t0 = time.monotonic()
        path = run_arm(
            experiment,
            arm,
            repeat,
            workload,
            run_dir,
            progress=progress,
            prompt_salt=salt,
            window_s=window,
        )
        summary = summarize_run(load_run(path))
        write_summary(summary)
        if sequence is not None:
            sequence.summaries[run_dir] = summary
        v = summary.values
        log(
            f"  [{done}/{len(todo)}] {arm.name} repeat {repeat + 1}: {v['requests_ok']} "
            f"requests ok, P90 interactivity {_num(v['p90_interactivity_tok_s'])} tok/s/user "
            f"({time.monotonic() - t0:.1f} s)"
        )
        if sequence is not None and sequence.add_if_block_done(repeat):
            log(f"agentab ab: {sequence.line()}")
            break
    a, b = experiment.arms
    repeats = limit if sequence is None else sequence.blocks
    comparison = compare_runs(
        [load_run(arm_run_dir(out_dir, a, k)) for k in range(repeats)],
        [load_run(arm_run_dir(out_dir, b, k)) for k in range(repeats)],
        resamples=experiment.resamples,
        seed=experiment.seed,
        confidence=experiment.confidence,
        equivalence_margin=experiment.equivalence_margin,
        slo=experiment.slo,
    )
    header = [
        f"Experiment `{experiment.name}` ({experiment.path.name}), engine "
        f"{experiment.engine_kind}"
        + (f" profile {experiment.engine['profile']}" if "profile" in experiment.engine else "")
        + f", {_repeats(repeats)} per arm run in ABBA order.",
        *experiment.notes,
    ]
    if sequence is not None:
        comparison.extra["sequential"] = {**sequence.decision.to_json(), "block_s": window}
        header.insert(0, f"**Sequential** (--until-decided): {sequence.line()}.")
    title = f"{experiment.name}: {a.name} (A) vs {b.name} (B)"
    markdown = comparison_markdown(comparison, title=title, header=header)
    comparison.extra["experiment"] = {"name": experiment.name, "dir": str(out_dir)}
    (out_dir / "comparison.json").write_bytes(
        orjson.dumps(comparison.to_json(), option=orjson.OPT_INDENT_2)
    )
    (out_dir / "report.md").write_text(markdown, encoding="utf-8")
    write_html(comparison, out_dir / "report.html", title=title, header=header)
    log(f"agentab ab: done in {time.monotonic() - started:.1f} s; reports in {out_dir}")
    return comparison, markdown


class _Sequence:
    """The blocks so far of an `--until-decided` run and the verdict they give."""

    def __init__(self, experiment: Experiment, out_dir: Path, window_s: float | None) -> None:
        self.experiment = experiment
        self.out_dir = out_dir
        self.window_s = window_s
        self.estimates: list[Any] = []
        self.summaries: dict[Path, Any] = {}  # runs this invocation summarized already
        self.blocks = 0
        self.decision: Any = None

    def add_if_block_done(self, repeat: int) -> bool:
        """After a run: when both arms of `repeat` are done, add the block; True = decided."""
        from agentab.analysis.compare import WITHHELD
        from agentab.analysis.sequential import SequentialDecision, block_estimate, decide

        a, b = (arm_run_dir(self.out_dir, arm, repeat) for arm in self.experiment.arms)
        if repeat < self.blocks or not (is_complete(a) and is_complete(b)):
            return False
        self.estimates.append(block_estimate(self._summary(a), self._summary(b)))
        self.blocks = repeat + 1
        verdict, center, low, high = decide(
            self.estimates,
            confidence=self.experiment.confidence,
            margin=self.experiment.equivalence_margin,
        )
        self.decision = SequentialDecision(verdict, self.blocks, center, low, high)
        return verdict != WITHHELD

    def _summary(self, run_dir: Path) -> Any:
        summary = self.summaries.pop(run_dir, None)
        return summary if summary is not None else summarize_run(load_run(run_dir))

    def line(self) -> str:
        d = self.decision
        if d is None:
            return "no block completed"
        state = f"decided **{d.verdict}**" if d.verdict != "no verdict" else "undecided"
        level = f"{100 * self.experiment.confidence:.0f}%"
        if math.isinf(d.high):
            interval = f"its always-valid {level} interval still unbounded (too few blocks)"
        else:
            interval = f"always-valid {level} interval {d.low:.3f} – {d.high:.3f}"
        return (
            f"{state} after {_repeats(d.blocks)} per arm{_of_seconds(self.window_s)}: "
            f"B/A {d.ratio:.3f}, {interval} "
            "(a confidence sequence: valid whenever the experiment stopped)"
        )


def arm_run_dir(out_dir: Path, arm: Arm, repeat: int) -> Path:
    """Where (arm, repeat) lives in the experiment dir (repeat counts from 0)."""
    return out_dir / arm.name / f"run-{repeat + 1}"


def _of_seconds(window_s: float | None) -> str:
    return "" if window_s is None else f" of {window_s:g} s"


def _repeats(n: int) -> str:
    return f"{n} repeat" if n == 1 else f"{n} repeats"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"
