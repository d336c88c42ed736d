"""`agentab replay` (a URL, real clock) and `agentab simulate` (the simulator, virtual clock).

Both take the same replay options and write the same run-dir format; only the target differs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from agentab.engine.cli import simulator_options, simulator_options_of
from agentab.errors import AgentabError
from agentab.outputs import OutputPath, output_help
from agentab.replay.options import ENDPOINTS, ReplayOptions


def _replay_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options shared by `replay` and `simulate` (ReplayOptions fields)."""
    opts = [
        click.argument("workload", type=click.Path(path_type=Path)),
        click.option("--format", "fmt", default=None, help="Workload format (detected if unset)."),
        click.option(
            "--block-size",
            type=click.IntRange(min=1),
            default=None,
            help="Tokens per hash block of a Mooncake trace (default 512).",
        ),
        click.option(
            "--out",
            "out_dir",
            required=True,
            type=OutputPath("dir"),
            help=output_help("Run dir."),
        ),
        click.option(
            "--concurrency",
            type=click.IntRange(min=1),
            default=None,
            help="Closed loop: N lanes, each holding one session tree (default 1).",
        ),
        click.option("--rate", type=float, default=None, help="Open loop: sessions per second."),
        click.option(
            "--time-scale",
            type=float,
            default=None,
            help="Open loop: recorded session arrivals times this factor.",
        ),
        click.option(
            "--duration",
            "duration_s",
            type=float,
            default=3600.0,
            show_default=True,
            help="Profiling window in seconds, counted from the end of the warmup (0: no limit).",
        ),
        click.option(
            "--drain",
            "drain_s",
            type=click.FloatRange(min=0.0, min_open=True),
            default=None,
            help="Seconds requests in flight when the window closes may take to finish; those "
            "still running then are cut (recorded as cancelled, in no metric) and the manifest "
            "says how many (default: the window's length).",
        ),
        click.option(
            "--max-behind-plan",
            "max_behind_plan_ms",
            type=click.FloatRange(min=0.0, min_open=True),
            default=10.0,
            show_default=True,
            metavar="MS",
            help="Analysis refuses the run if a client sent its requests more than this late "
            "against their plan at P90 (a saturated client times itself, not the server); "
            "raise it only where the server shares the client's cores.",
        ),
        click.option("--max-requests", type=int, default=None, help="Stop after N requests."),
        click.option(
            "--lane-requests",
            type=click.IntRange(min=1),
            default=None,
            help="Closed loop: each lane stops after N profiling requests, so two runs of one "
            "plan send the same requests whatever their speeds.",
        ),
        click.option(
            "--start-window",
            nargs=2,
            type=float,
            default=(0.25, 0.75),
            show_default=True,
            help="Lane start points as fractions of a session (0 0: first turn).",
        ),
        click.option(
            "--warmup-requests",
            type=int,
            default=10,
            show_default=True,
            help="Warmup requests per lane (max_tokens 1; 0 disables warmup).",
        ),
        click.option(
            "--idle-cap-global",
            "idle_cap_global_s",
            type=float,
            default=10.0,
            show_default=True,
            help="Global idle compression cap in s (0 disables).",
        ),
        click.option(
            "--idle-cap-tree",
            "idle_cap_tree_s",
            type=float,
            default=300.0,
            show_default=True,
            help="Per-tree idle compression cap in s (0 disables).",
        ),
        click.option("--seed", type=int, default=42, show_default=True),
        click.option(
            "--prompt-salt",
            default=None,
            help="Salt of every prompt (default: a fresh one per run, so a rerun does not hit "
            "the cache a previous run left); give a run's manifest replay.prompt_salt to send "
            "its exact prompts again.",
        ),
        click.option("--passes", type=int, default=None, help="Sessions per lane, then stop."),
        click.option("--max-error-rate", type=float, default=0.10, show_default=True),
        click.option(
            "--endpoint", type=click.Choice(ENDPOINTS), default="completions", show_default=True
        ),
        click.option(
            "--request-timeout",
            "request_timeout_s",
            type=float,
            default=600.0,
            show_default=True,
            help="Longest silence before a request times out (s).",
        ),
        click.option("--scrape-metrics", is_flag=True, help="Poll the server's /metrics."),
        click.option(
            "--scrape-interval", "scrape_interval_s", type=float, default=1.0, show_default=True
        ),
        click.option("--arm", default=None, help="Arm name in the manifest (default: dir name)."),
        click.option("--quiet", is_flag=True, help="No progress bar."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _options(kw: dict[str, Any]) -> ReplayOptions:
    if kw["concurrency"] is not None and (kw["rate"] is not None or kw["time_scale"] is not None):
        raise AgentabError("--concurrency is closed loop; do not combine with --rate/--time-scale")
    if kw["rate"] is not None and kw["time_scale"] is not None:
        raise AgentabError("--rate and --time-scale are two open-loop modes; choose one")
    return ReplayOptions(
        concurrency=kw["concurrency"] or 1,
        rate=kw["rate"],
        time_scale=kw["time_scale"],
        duration_s=kw["duration_s"] or None,
        max_requests=kw["max_requests"],
        lane_requests=kw["lane_requests"],
        start_window=tuple(kw["start_window"]),
        warmup_requests=kw["warmup_requests"],
        idle_cap_global_s=kw["idle_cap_global_s"],
        idle_cap_tree_s=kw["idle_cap_tree_s"],
        seed=kw["seed"],
        passes=kw["passes"],
        max_error_rate=kw["max_error_rate"],
        endpoint=kw["endpoint"],
        request_timeout_s=kw["request_timeout_s"],
        scrape_metrics=kw["scrape_metrics"],
        scrape_interval_s=kw["scrape_interval_s"],
        prompt_salt=kw["prompt_salt"],
        drain_s=kw["drain_s"],
        max_behind_plan_ms=kw["max_behind_plan_ms"],
    )


def _load(kw: dict[str, Any]) -> Any:
    from agentab.workloads import load

    return load(kw["workload"], kw["fmt"], block_size=kw["block_size"], freeze=True)


def _extra(kw: dict[str, Any]) -> dict[str, Any] | None:
    return {"arm": kw["arm"]} if kw["arm"] else None


def _summary(run_dir: Path) -> None:
    from agentab.rundir import read_manifest

    s = read_manifest(run_dir).get("stats", {})
    click.echo(
        f"wrote {run_dir}: {s.get('finished', 0)} requests "
        f"({s.get('warmup_requests', 0)} warmup), {s.get('errors', 0)} errors "
        f"({s.get('error_rate', 0.0):.1%}), stopped by {s.get('stop_reason')}, "
        f"{s.get('elapsed_s', 0.0):,.1f} s"
    )


@click.command("replay")
@_replay_options
@click.option(
    "--url",
    "urls",
    required=True,
    multiple=True,
    help="OpenAI-compatible server, e.g. http://127.0.0.1:8000. Repeat it for data-parallel "
    "replicas of one server (`agentab serve --replicas N` prints their URLs): lane k goes to "
    "URL k mod R, so each session stays on one replica; records say which URL served them "
    "(`target`) and the manifest lists them (`targets`).",
)
@click.option("--model", default=None, help="Model name (default: the first of /v1/models).")
@click.option("--api-key-env", default=None, help="Environment variable holding the API key.")
@click.option(
    "--clients",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Send the plan from N client processes (on this host; with --ray, on a Ray cluster's "
    "hosts), lanes split among them, started together, records merged into one run dir. For "
    "loads one process cannot time: the manifest's `clients` records each one's chunk rate "
    "and event-loop lag, and the report refuses a run whose client fell behind its plan.",
)
@click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="ADDRESS",
    help="Run the --clients N client processes as Ray actors spread over a cluster's nodes: "
    "`local` (a cluster started in this process), `auto`, HOST:PORT or ray://HOST:10001. "
    "They start together on the hosts' wall clocks and their records come back here.",
)
def replay(**kw: Any) -> None:
    """Replay WORKLOAD against an OpenAI-compatible server (real clock)."""
    from agentab.replay.api import replay_to_dir

    if kw["ray_address"] is not None and kw["clients"] < 2:
        raise AgentabError(
            f"--ray {kw['ray_address']}: places the client processes of --clients N (N > 1) on "
            "a Ray cluster; add --clients"
        )
    if kw["clients"] > 1:
        from agentab.replay.shards import sharded_replay_to_dir

        run_dir = sharded_replay_to_dir(
            _load(kw),
            url=kw["urls"],
            replay=_options(kw),
            out_dir=kw["out_dir"],
            clients=kw["clients"],
            model=kw["model"],
            api_key_env=kw["api_key_env"],
            manifest_extra=_extra(kw),
            log=None if kw["quiet"] else lambda line: click.echo(line, err=True),
            ray_address=kw["ray_address"],
        )
        _summary(run_dir)
        return
    run_dir = replay_to_dir(
        _load(kw),
        url=kw["urls"],
        replay=_options(kw),
        out_dir=kw["out_dir"],
        model=kw["model"],
        api_key_env=kw["api_key_env"],
        manifest_extra=_extra(kw),
        progress=not kw["quiet"],
    )
    _summary(run_dir)


@click.command("simulate")
@_replay_options
@simulator_options
def simulate(**kw: Any) -> None:
    """Replay WORKLOAD against the in-process simulator on the virtual clock."""
    from agentab.replay.api import simulate_to_dir

    engine_options = simulator_options_of(
        kw, profile=kw["profile"], decode_backend=kw["decode_backend"]
    )
    run_dir = simulate_to_dir(
        _load(kw),
        engine_options=engine_options,
        replay=_options(kw),
        out_dir=kw["out_dir"],
        manifest_extra=_extra(kw),
        progress=not kw["quiet"],
    )
    _summary(run_dir)
