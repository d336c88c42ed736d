"""`agentab calibrate` and `agentab fidelity` (docs/engine.md, "Calibration and fidelity")."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from agentab.calibrate.load import DEFAULT_BATCHES
from agentab.calibrate.write import ASSUMABLE
from agentab.errors import AgentabError
from agentab.extras import require
from agentab.outputs import OutputPath, output_help


def _ints(value: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise AgentabError(f"{flag} {value!r}: expected comma-separated integers") from None


def _only(
    value: str | None, local: dict[str, Any] | None, local_paths: tuple[str, ...]
) -> tuple[str, ...] | None:
    """--only's servers, each one this calibration would launch."""
    if value is None:
        return None
    if local is None:
        raise AgentabError("--only: the local engine's servers; add --engine local")
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    launched = (*local_paths, *(("drafter",) if local.get("speculative_config") else ()))
    for name in names:
        if name not in ("standard", "specialized", "drafter"):
            raise AgentabError(f"--only: unknown server {name!r} (standard, specialized, drafter)")
        if name not in launched:
            need = "--specialized" if name == "specialized" else "a speculative_config"
            raise AgentabError(f"--only {name}: this calibration has no {name} server ({need})")
    if not names:
        raise AgentabError("--only: name at least one server (standard, specialized, drafter)")
    return names


def _command_line(ctx: click.Context) -> str:
    """The command as it was given (every option that differs from its default)."""
    words = ctx.command_path.split()
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if isinstance(param, click.Argument):
            words.append(str(value))
            continue
        if value is None or value == param.default or value == () or value is False:
            continue
        flag = param.opts[0]
        if value is True:
            words.append(flag)
        elif isinstance(value, tuple) and param.multiple:
            for v in value:
                words += [flag, str(v)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def _engine_options(path: Path) -> dict[str, Any]:
    """The [engine] table of an experiment of kind local: the options its arms' servers get."""
    from agentab.experiments.experiment import load_experiment

    experiment = load_experiment(path)
    if experiment.engine_kind != "local":
        raise AgentabError(
            f"--engine-config {path}: [engine] kind is {experiment.engine_kind!r}; "
            'calibration launches a local engine (kind "local")'
        )
    return dict(experiment.engine)


@click.command("calibrate")
@click.option(
    "-o",
    "--out",
    "out",
    required=True,
    type=OutputPath(),
    help=output_help(
        "Profile to write (NAME.toml); the fit report goes beside it as NAME.fit.json."
    ),
)
@click.option("--url", default=None, help="Server to time (running decode_backend auto).")
@click.option(
    "--specialized-url",
    default=None,
    help="A second server running decode_backend latency_specialized: times that path.",
)
@click.option(
    "--engine",
    "engine_kind",
    type=click.Choice(["local"]),
    default=None,
    help="Launch agentab's local engine here instead of timing a URL (one server per path).",
)
@click.option(
    "--engine-config",
    type=click.Path(path_type=Path),
    default=None,
    help="Local engine: take its options from this experiment's [engine] table (kind local), "
    "so the profile is fitted to the engine that experiment runs. Implies --engine local.",
)
@click.option(
    "--refit",
    "refit_report",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    multiple=True,
    help="Time nothing: fit the measurements recorded in this fit report (NAME.fit.json) "
    "again, e.g. after the step-time model gained a term. Facts and clock are the report's. "
    "Repeated: the parts of one calibration timed with --only, fitted together.",
)
@click.option(
    "--only",
    default=None,
    help="Local engine: time only these of its servers (standard, specialized, drafter; "
    "comma-separated) and write their measurements (NAME.fit.json) without a profile, for a "
    "calibration split over sittings; --refit A.fit.json --refit B.fit.json fits the parts.",
)
@click.option(
    "--allow-engine-change",
    is_flag=True,
    help="With --refit of parts timed on different engine code (agentab's engine source "
    "digest): fit them anyway, for a change known to leave the steps' time alone (e.g. the "
    "host scheduler's speed). The profile names each part's engine source, and `agentab "
    "fidelity` notes that its errors include the change.",
)
@click.option("--preset", default=None, help="Local engine preset (tiny: CPU).")
@click.option("--device", default=None, help="Local engine device (cpu, cuda).")
@click.option(
    "--specialized", is_flag=True, help="Local engine: also time the latency_specialized path."
)
@click.option("--name", default=None, help="Profile name [default: the file name].")
@click.option(
    "--timing",
    type=click.Choice(["auto", "client", "engine"]),
    default="auto",
    show_default=True,
    help="engine: the engine's own step counters (agentab engines export them); client: "
    "chunk arrival times; auto: engine where exported.",
)
@click.option(
    "--batches",
    default=",".join(map(str, DEFAULT_BATCHES)),
    show_default=True,
    help="Decode batch sizes timed (the profile's table points).",
)
@click.option(
    "--contexts",
    default=None,
    help="Short,long prompt tokens of the decode phases [sized to the server].",
)
@click.option("--steps", type=int, default=96, show_default=True, help="Decode tokens per phase.")
@click.option(
    "--prefill-repeats", type=int, default=3, show_default=True, help="Requests per prefill point."
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Prompt generator seed, to send the same prompts again [default: a fresh one each run, "
    "recorded in the fit report, so no prompt an earlier calibration left in the server's "
    "prefix cache is hit].",
)
@click.option("--gpu-count", type=int, default=None, help="GPUs of the engine, if it does not say.")
@click.option("--tp", type=int, default=None, help="Tensor-parallel degree, if it does not say.")
@click.option(
    "--prefill-graph-tokens",
    default=None,
    help="Token counts of the engine's prefill graphs (e.g. 16,32,...,2048), if it does not say "
    "(or its --refit report predates them): steps with prefill are padded to them.",
)
@click.option(
    "--allow-assumed",
    multiple=True,
    type=click.Choice(sorted(ASSUMABLE)),
    help="Write this field although the load could not identify it (repeatable).",
)
@click.option("--model", default=None, help="Model name [default: the server's first].")
@click.option("--quiet", is_flag=True, help="No per-phase progress lines.")
@click.pass_context
def calibrate(ctx: click.Context, **kw: Any) -> None:
    """Fit a hardware profile to a running engine by timing a controlled load.

    Decode phases (every batch size at a short and a long context) time the decode table and
    the per-context-token KV cost; single prefill requests of several lengths, with and without
    a cached prefix, time the per-token and per-token-pair prefill costs; mixed phases (one
    prompt beside a quarter, half and all of the largest batch decoding) time the cost per
    decode row of a step that also computes a prompt (not with vLLM's clock). The engine's own
    facts give the KV block size and capacity, GPU count, CUDA-graph padding and whether it
    schedules one step ahead. Fields the load cannot identify are named, and the profile is
    refused unless --allow-assumed accepts each of them.
    """
    from agentab.calibrate.calibrate import CalibrateRequest
    from agentab.calibrate.calibrate import calibrate as run

    local = None
    urls: dict[str, str] = {}
    if kw["refit_report"]:
        clash = [
            k for k in ("url", "specialized_url", "engine_kind", "engine_config", "only") if kw[k]
        ]
        if clash:
            raise AgentabError("--refit times nothing; drop the server options")
    elif kw["allow_engine_change"]:
        raise AgentabError("--allow-engine-change applies to --refit only")
    elif kw["engine_config"] is not None:
        if kw["preset"] or kw["device"]:
            raise AgentabError(
                "--engine-config gives the local engine's options; drop --preset / --device"
            )
        kw["engine_kind"] = "local"
    if kw["engine_kind"] == "local":
        if kw["url"] or kw["specialized_url"]:
            raise AgentabError("--engine local launches its own servers; drop --url")
        require("torch", "--engine local (the local torch engine)")
        if kw["engine_config"] is not None:
            local = _engine_options(kw["engine_config"])
        elif not kw["preset"]:
            raise AgentabError("--engine local needs --preset (tiny or k2-tp8-shard)")
        else:
            local = {"preset": kw["preset"]}
            if kw["device"]:
                local["device"] = kw["device"]
    elif not kw["refit_report"]:
        if not kw["url"]:
            raise AgentabError("give --url (a running server) or --engine local --preset NAME")
        if kw["preset"] or kw["device"] or kw["specialized"]:
            raise AgentabError(
                "--preset, --device, --specialized: local-engine options; add --engine local"
            )
        urls["standard"] = kw["url"]
        if kw["specialized_url"]:
            urls["specialized"] = kw["specialized_url"]
    contexts = _ints(kw["contexts"], "--contexts") if kw["contexts"] else None
    if contexts is not None and len(contexts) != 2:
        raise AgentabError(f"--contexts {kw['contexts']}: expected SHORT,LONG")
    local_paths = ("standard", "specialized") if kw["specialized"] else ("standard",)
    only = _only(kw["only"], local, local_paths)
    out: Path = kw["out"]
    if out.suffix != ".toml":
        raise AgentabError(f"-o {out}: a profile is a .toml file")
    req = CalibrateRequest(
        out=out,
        name=kw["name"] or out.stem,
        urls=urls,
        local=local,
        local_paths=local_paths,
        timing=kw["timing"],
        batches=_ints(kw["batches"], "--batches"),
        contexts=contexts,  # type: ignore[arg-type]
        steps=kw["steps"],
        prefill_repeats=kw["prefill_repeats"],
        seed=kw["seed"],
        gpu_count=kw["gpu_count"],
        tp=kw["tp"],
        allow_assumed=tuple(kw["allow_assumed"]),
        model=kw["model"],
        command=_command_line(ctx),
        only=only,
        allow_engine_change=kw["allow_engine_change"],
        prefill_graph_tokens=(
            _ints(kw["prefill_graph_tokens"], "--prefill-graph-tokens")
            if kw["prefill_graph_tokens"]
            else None
        ),
    )
    echo = (lambda s: None) if kw["quiet"] else (lambda s: click.echo(s, err=True))

    def warn(message: str) -> None:
        click.echo(f"agentab: warning: {message}", err=True)

    if kw["refit_report"]:
        from agentab.calibrate.calibrate import refit

        profile, report, summary = refit(req, kw["refit_report"])
    else:
        profile, report, summary = run(req, echo, warn)
    if only is not None:
        click.echo(f"wrote {report}: {summary}")
    else:
        click.echo(f"wrote {profile} and {report}: {summary}")


# the fidelity flags that are replay options (ReplayOptions fields of the same names)
REPLAY_OPTIONS = (
    "concurrency",
    "passes",
    "max_requests",
    "duration_s",
    "warmup_requests",
    "start_window",
    "idle_cap_global_s",
    "idle_cap_tree_s",
    "seed",
)
# what a replay run now takes and a recorded A/B (--ab) already has
LIVE_ONLY = ("workload", "url", *REPLAY_OPTIONS, "fmt", "model", "b_url")


@click.command("fidelity")
@click.argument("workload", type=click.Path(path_type=Path), required=False)
@click.option(
    "--profile", required=True, type=click.Path(path_type=Path), help="Calibrated profile."
)
@click.option("--url", default=None, help="The real engine (decode_backend auto, arm A).")
@click.option(
    "--ab",
    "ab_dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Instead of replaying now: an `agentab ab` experiment dir whose completed runs are "
    "the measurement; each is simulated with its own recorded plan (no WORKLOAD, --url or "
    "replay options).",
)
@click.option(
    "--b-url", default=None, help="A second server (arm B) for the predicted vs measured B/A ratio."
)
@click.option(
    "--b-decode-backend",
    default="latency_specialized",
    show_default=True,
    help="What the B server runs (the simulator runs the same).",
)
@click.option(
    "-o",
    "--out",
    "out_dir",
    required=True,
    type=OutputPath("dir"),
    help=output_help("Folder for fidelity.json, fidelity.md and the run dirs."),
)
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--passes", type=int, default=1, show_default=True, help="Sessions per lane.")
@click.option("--max-requests", type=int, default=None, help="Stop after N requests.")
@click.option(
    "--duration",
    "duration_s",
    type=float,
    default=0.0,
    show_default=True,
    help="Dispatch window in s (0: none; a window makes the faster side send more).",
)
@click.option("--warmup-requests", type=int, default=2, show_default=True)
@click.option(
    "--start-window",
    nargs=2,
    type=float,
    default=(0.0, 0.0),
    show_default=True,
    help="Lane start points as fractions of a session (0 0: each lane starts a session).",
)
@click.option("--idle-cap-global", "idle_cap_global_s", type=float, default=10.0, show_default=True)
@click.option("--idle-cap-tree", "idle_cap_tree_s", type=float, default=300.0, show_default=True)
@click.option("--seed", type=int, default=42, show_default=True)
@click.option("--format", "fmt", default=None, help="Workload format (detected if unset).")
@click.option("--model", default=None, help="Model name [default: the server's first].")
@click.option("--max-num-seqs", type=int, default=None, help="[default: from the fit report]")
@click.option(
    "--max-num-batched-tokens", type=int, default=None, help="[default: from the fit report]"
)
@click.option("--block-size", type=int, default=None, help="[default: from the fit report]")
@click.option("--kv-blocks", type=int, default=None, help="[default: from the fit report]")
@click.option("--json", "as_json", is_flag=True, help="Print fidelity.json instead of the table.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.pass_context
def fidelity(ctx: click.Context, **kw: Any) -> None:
    """Replay WORKLOAD on the real engine and on the simulator with a calibrated profile.

    Same workload, replay plan and seed on both; prints P50/P90/P99 of ITL, TTFT and E2E,
    decode throughput, P90 interactivity and the cache hit ratio side by side with the
    simulator's relative error, and writes OUT/fidelity.json, OUT/fidelity.md and the run dirs.
    With --ab, the measurement is an A/B that already ran: every completed run of the
    experiment dir is simulated with the plan it recorded, and both sides are pooled over
    repeats as the A/B report pools them.
    """
    from agentab.calibrate.fidelity import Arm, run_fidelity, simulator_options, write_result
    from agentab.calibrate.write import read_report
    from agentab.replay.options import ReplayOptions
    from agentab.workloads import load

    profile: Path = kw["profile"]
    from agentab.engine.profile import load_profile

    load_profile(profile)  # a bad profile fails before anything is sent
    overrides = {
        k: kw[k] for k in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_blocks")
    }
    report = read_report(profile)
    engine_options = simulator_options(profile, report, overrides)
    if kw["ab_dir"] is not None:
        _fidelity_of_recorded(ctx, kw, engine_options, report)
        return
    if kw["workload"] is None or kw["url"] is None:
        raise AgentabError("give WORKLOAD and --url (replay now), or --ab DIR (a recorded A/B)")
    replay = ReplayOptions.from_mapping(
        {k: kw[k] for k in REPLAY_OPTIONS} | {"duration_s": kw["duration_s"] or None}
    )
    arms = [Arm("A", kw["url"], "auto")]
    if kw["b_url"]:
        arms.append(Arm("B", kw["b_url"], kw["b_decode_backend"]))
    result = run_fidelity(
        load(kw["workload"], kw["fmt"], freeze=True),
        arms=arms,
        engine_options=engine_options,
        replay=replay,
        out_dir=kw["out_dir"],
        model=kw["model"],
        progress=not kw["quiet"],
        profile_report=report,
    )
    path = write_result(kw["out_dir"], result)
    if kw["as_json"]:
        click.echo(path.read_text())
    else:
        from agentab.calibrate.fidelity import render_table

        click.echo(render_table(result))
        click.echo(f"wrote {path}")


def _fidelity_of_recorded(
    ctx: click.Context,
    kw: dict[str, Any],
    engine_options: dict[str, Any],
    report: dict[str, Any] | None,
) -> None:
    from click.core import ParameterSource

    from agentab.calibrate.fidelity import render_table, write_result
    from agentab.calibrate.recorded import predict_recorded

    given = [
        name
        for name in LIVE_ONLY
        if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
    ]
    if given:
        flags = ", ".join("WORKLOAD" if g == "workload" else _flag(ctx, g) for g in given)
        raise AgentabError(f"--ab replays the plans its runs recorded; drop {flags}")
    echo = (lambda s: None) if kw["quiet"] else (lambda s: click.echo(s, err=True))
    result = predict_recorded(
        kw["ab_dir"],
        engine_options=engine_options,
        out_dir=kw["out_dir"],
        progress=not kw["quiet"],
        echo=echo,
        profile_report=report,
    )
    path = write_result(kw["out_dir"], result)
    click.echo(path.read_text() if kw["as_json"] else render_table(result))
    if not kw["as_json"]:
        click.echo(f"wrote {path}")


def _flag(ctx: click.Context, name: str) -> str:
    for param in ctx.command.params:
        if param.name == name and isinstance(param, click.Option):
            return max(param.opts, key=len)
    return name


@click.command("acceptance")
@click.argument("run_dir", required=False, type=click.Path(path_type=Path))
@click.option(
    "--url",
    default=None,
    help="A live server instead of a run dir: its base URL (or /metrics address); the counters "
    "hold everything since it started.",
)
@click.option(
    "-o",
    "--out",
    type=OutputPath(),
    default=None,
    help=output_help(
        "Write the rates as TOML: [speculative_config] for the local engine "
        "(`serve --speculative-config FILE`), [simulator] for the simulator "
        "(`--acceptance-probs FILE`)."
    ),
)
def acceptance(run_dir: Path | None, url: str | None, out: Path | None) -> None:
    """Per-position acceptance rates of a speculative-decoding server, for replay.

    Reads vLLM's counters (spec_decode_num_drafts, spec_decode_num_accepted_tokens_per_pos) from
    RUN_DIR (a recorded run, or a folder of runs pooled: their profiling phases) or from --url,
    and prints the mean acceptance length and each position's rate, accepted there / drafts: the
    synthetic_acceptance_rates the local engine and the simulator replay (docs/engine.md).
    """
    from agentab.calibrate.acceptance import from_runs, from_url, summary_lines, to_toml

    if (run_dir is None) == (url is None):
        raise click.UsageError("give exactly one of RUN_DIR or --url")
    measured = from_runs(run_dir) if run_dir is not None else from_url(str(url))
    for line in summary_lines(measured):
        click.echo(line)
    if out is not None:
        out.write_text(to_toml(measured), encoding="utf-8")
        click.echo(f"  written: {out}")
