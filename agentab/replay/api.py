"""Run a workload into a run dir: against a URL (real clock) or the simulator (virtual clock).

`simulate_to_dir` and `replay_to_dir` are the entry points the CLI and the A/B orchestration
call (docs/interfaces.md, replay). Both go through `run_to_dir`, which owns the order that
makes a run dir trustworthy: manifest first, records appended during the run, manifest
rewritten with the outcome last, and a failure (error rate, interruption) raised only after
everything is on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentab.clock import is_virtual, run_real, run_virtual
from agentab.dir_lock import lock_dir, release_dir
from agentab.errors import AgentabError, AgentabWarning
from agentab.redact import has_credentials, redact_url
from agentab.replay.client_load import LoopLag, client_load
from agentab.replay.eager import eager_tasks
from agentab.replay.manifest import build_manifest, now_iso, prepare_run_dir
from agentab.replay.metrics import scrape_loop, scrape_worker
from agentab.replay.options import ReplayOptions, new_prompt_salt
from agentab.replay.plan import Plan, build_plan
from agentab.replay.progress import ProgressView, line_interval_s
from agentab.replay.runner import Runner, RunStats
from agentab.replay.targets.base import RequestSpec, Target
from agentab.rundir import (
    METRICS_DIR,
    METRICS_SCHEMA,
    RECORD_SCHEMA,
    RECORDS_DIR,
    PartWriter,
    write_manifest,
)
from agentab.workloads.model import Workload

if TYPE_CHECKING:
    from agentab.engine.options import SimulatorOptions

EXIT_INTERRUPTED = 130


def run_to_dir(
    workload: Workload,
    target: Target,
    *,
    replay: ReplayOptions,
    out_dir: str | Path,
    virtual: bool,
    manifest_extra: dict[str, Any] | None = None,
    progress: bool = True,
    label: str = "replay",
) -> Path:
    """Replay `workload` against `target` into `out_dir`; return the run dir.

    Raises AgentabError (after writing everything) when the run was interrupted or its error
    rate exceeded `replay.max_error_rate`.
    """
    if progress:
        line_interval_s()  # a bad AGENTAB_PROGRESS_INTERVAL_S fails before the run dir exists
    if replay.prompt_salt is None:
        replay = dataclasses.replace(replay, prompt_salt=new_prompt_salt())
    with _inputs_frozen():
        plan = build_plan(workload, replay)
        if workload.num_requests() == 0:
            raise AgentabError(f"{workload.source or 'workload'}: no requests to replay")
        # one process per run dir, taken before its manifest is looked for: two replays into
        # one dir would interleave their records
        lock_dir(Path(out_dir), f"agentab {label}", "--out")
        try:
            run_dir = prepare_run_dir(out_dir)
            coro = _run(workload, target, plan, run_dir, replay, manifest_extra, progress, label)
            stats, _manifest = run_virtual(coro) if virtual else run_real(coro)
        finally:
            release_dir(Path(out_dir))
    _raise_if_failed(stats, replay, run_dir)
    return run_dir


def first_request(plan: Plan, client: int, clients: int) -> RequestSpec | None:
    """The first request client `client` of `clients` will send: what `Target.warm` builds
    before the clock starts (any request of the plan would do)."""
    if plan.options.open_loop:
        play = next((p for _, p in plan.arrivals() if p.lane % clients == client), None)
    else:
        play = plan.closed_play(client, 0)
    if play is None:
        return None
    node = next((n for n in play.schedule.nodes if n.request is not None), None)
    if node is None or node.request is None:
        return None
    return RequestSpec(
        play.request_id(node), play.session, node.request, play.salt, node.max_tokens, play.lane
    )


async def _run(
    workload: Workload,
    target: Target,
    plan: Any,
    run_dir: Path,
    replay: ReplayOptions,
    manifest_extra: dict[str, Any] | None,
    progress: bool,
    label: str,
) -> tuple[RunStats, dict[str, Any]]:
    records: PartWriter | None = None
    metrics: PartWriter | None = None
    scraper: asyncio.Task[None] | None = None
    stop_scrape = asyncio.Event()
    try:
        await target.start()
        facts = target.describe()
        manifest_extra = {**(manifest_extra or {}), **_backend_label(facts, manifest_extra)}
        manifest = build_manifest(
            workload,
            replay,
            run_dir,
            target_facts=facts,
            manifest_extra=manifest_extra,
        )
        loop = asyncio.get_running_loop()
        write_manifest(run_dir, manifest)
        records = PartWriter(run_dir / RECORDS_DIR, RECORD_SCHEMA)
        runner = Runner(plan, target, records)
        spec = first_request(plan, 0, 1)
        if spec is not None:
            target.warm(spec)  # the prompt builder's first-use compile, before the clock starts
        if replay.scrape_metrics:
            if not is_virtual(loop):
                scrape_worker()  # its thread started before the clock starts
            metrics = PartWriter(run_dir / METRICS_DIR, METRICS_SCHEMA)
            scraper = loop.create_task(
                scrape_loop(
                    target.scrape,
                    metrics,
                    t0=loop.time(),
                    interval_s=replay.scrape_interval_s,
                    stop=stop_scrape,
                )
            )
        with (
            ProgressView(runner, enabled=progress, label=f"{label} {run_dir}"),
            _gc_frozen(loop),
            eager_tasks(loop) if not is_virtual(loop) else contextlib.nullcontext(),
        ):
            lag = None if is_virtual(loop) else LoopLag(loop)  # after the freeze's collection
            stats = await runner.run()
        manifest["clock_t0"] = runner.t0
        if lag is not None:
            lag.stop()
            manifest["clients"] = [runner_load(runner, 0, lag)]
        _warn_if_replayed_often(runner.plays, len(workload), replay)
    finally:
        await close_run_io(stop_scrape, scraper, records, metrics, target)
    manifest.update(
        {
            "status": _status(stats, replay),
            "finished_at": now_iso(),
            "stats": stats.to_dict(),
        }
    )
    write_manifest(run_dir, manifest)
    return stats, manifest


def runner_load(runner: Runner, client: int, lag: LoopLag) -> dict[str, Any]:
    """The manifest's `clients` entry of one runner (`agentab.replay.client_load`)."""
    plan = runner.plan
    lanes = None if plan.options.open_loop else len(range(runner.shard, plan.lanes, runner.shards))
    return client_load(
        client,
        lanes,
        dispatched=runner.stats.dispatched,
        chunks=runner.chunks,
        t0=runner.t0,
        wall_s=runner.loop.time() - runner.t0,
        lags=lag.lags,
        behind=runner.behind,
    )


def _backend_label(facts: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """Whether the run's decode backend is what the server says it runs, or only what the
    experiment declares; a server that contradicts the declared label is refused (two attach
    URLs swapped would otherwise report the specialized server as `auto`)."""
    declared = (extra or {}).get("decode_backend")
    declared = getattr(declared, "value", declared)  # an experiment's arm gives the enum
    server = facts.get("server")
    if not isinstance(server, dict):
        server = {}
    observed = facts.get("decode_backend", server.get("decode_backend"))
    if declared is not None and observed is not None and declared != observed:
        where = facts.get("url") or "the server"
        raise AgentabError(
            f"decode_backend: the arm declares {declared!r} but {where} runs {observed!r} "
            "(are the arms' URLs swapped?)"
        )
    return {"decode_backend_source": "declared" if observed is None else "observed"}


YOUNG_LIMIT = 500_000
"""With automatic GC paused, collect the young generations once this many more container
objects exist than after the last collection (about 10x the live growth of 600 concurrent
streams): a run that does leave cyclic garbage (many failing requests, say) stays bounded."""


class _YoungGuard:
    """Checks the GC's young count every `interval_s` on the loop; a cheap timer, no task."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, limit: int = YOUNG_LIMIT, interval_s: float = 1.0
    ) -> None:
        self.loop = loop
        self.limit = limit
        self.interval_s = interval_s
        self.collections = 0
        self._handle = loop.call_later(interval_s, self._check)

    def _check(self) -> None:
        if gc.get_count()[0] > self.limit:
            gc.collect(1)
            self.collections += 1
        self._handle = self.loop.call_later(self.interval_s, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


@contextlib.contextmanager
def _inputs_frozen() -> Iterator[None]:
    """Keep the cyclic GC off the workload (and whatever else exists) from the moment a run is
    asked for, not only once it starts (`_gc_frozen`).

    Why: a workload that its loader did not freeze (one generated in-process, or passed to the
    library API) is still in the collector's oldest generation. Building the plan and the
    manifest's content hash allocates enough for the automatic GC to start full collections,
    each traversing every request's hash-id tuple: two of ~0.3 s each before a 100k-request
    simulation had begun. Only the young generations are collected before the freeze (a full
    collection would traverse the workload once more); garbage already in the oldest one is
    frozen with it and reclaimed after the unfreeze at the end. After a freeze made before (a
    frozen load) the garbage is collected in full first, since nothing unfreezes it later (the
    collection skips the frozen workload)."""
    with _frozen(young_only=True):
        yield


@contextlib.contextmanager
def _frozen(*, young_only: bool) -> Iterator[None]:
    """Collect, then move every live object to the collector's permanent generation; at the end
    hand back what this froze. A freeze made before (a command's frozen load: its workload
    lives as long as the process) is left in place; unfreezing would hand the workload back to
    every later collection, e.g. those of an A/B's next run. `young_only`: collect only the
    young generations first, unless a freeze made before means the garbage would stay."""
    frozen_before = gc.get_freeze_count() > 0
    gc.collect(1 if young_only and not frozen_before else 2)
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


async def close_run_io(
    stop_scrape: asyncio.Event, scraper: Any, records: Any, metrics: Any, target: Any
) -> None:
    """End a run's I/O in order: stop the scraper and wait for its last sample, close the
    record and metric writers (flushing their parts), close the target's connections."""
    stop_scrape.set()
    if scraper is not None:
        await scraper
    if records is not None:
        records.close()
    if metrics is not None:
        metrics.close()
    await target.close()


@contextlib.contextmanager
def _gc_frozen(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Keep the cyclic GC off everything that exists before the run (workload, plan, modules),
    and on the real clock pause automatic collection until the run ends.

    A full collection over a large workload's objects stalls the loop for 100+ ms, which shows
    up as dispatch lateness and chunk-time jitter; frozen objects are skipped by the GC. During
    a real-clock replay even the collections of what the run itself allocates (hundreds, the
    full ones 15-24 ms) made late dispatches, while the client leaves no cyclic garbage per
    request (docs/replay.md: the same ~3,000 objects after 1,000 or 12,000 requests, RSS flat),
    so only `_YoungGuard` collects, and only if young objects pile up. On the virtual clock
    pauses cost no accuracy and long simulations keep the automatic GC.

    A freeze made before the run is left in place at the end (`_frozen`).
    """
    with _frozen(young_only=False):
        paused = not is_virtual(loop) and gc.isenabled()
        guard = None
        if paused:
            gc.disable()
            guard = _YoungGuard(loop)
        try:
            yield
        finally:
            if guard is not None:
                guard.cancel()
            if paused:
                gc.enable()


REPLAYS_WARNED = 3
"""A closed-loop run that plays its trace's sessions more often than this, on average, warns:
its figures then rest on a few sessions weighed many times over."""


def _warn_if_replayed_often(plays: int, sessions: int, replay: ReplayOptions) -> None:
    if replay.open_loop or not sessions or plays <= REPLAYS_WARNED * sessions:
        return
    warnings.warn(
        f"the trace's {sessions} session(s) were played {plays} times in this run "
        f"({plays / sessions:.1f} plays each): the figures rest on few sessions weighed many "
        "times; use a longer trace, a shorter duration_s or fewer lanes, or cap it with passes",
        AgentabWarning,
        stacklevel=2,
    )


def _status(stats: RunStats, replay: ReplayOptions) -> str:
    if stats.stop_reason in ("interrupted", "error_rate", "write_error"):
        return stats.stop_reason
    if stats.finished and stats.error_rate > replay.max_error_rate:
        return "error_rate"
    return "completed"


def _raise_if_failed(stats: RunStats, replay: ReplayOptions, run_dir: Path) -> None:
    where = f"records in {run_dir}"
    if stats.stop_reason == "interrupted":
        raise AgentabError(
            f"{stats.message}; {stats.cancelled} in-flight request(s) recorded as cancelled; "
            f"{where}",
            exit_code=128 + stats.signal if stats.signal else EXIT_INTERRUPTED,
        )
    if stats.stop_reason == "error_rate":
        raise AgentabError(f"run ended early: {stats.message}; {where}")
    if stats.stop_reason == "write_error":
        raise AgentabError(f"run ended early: {stats.message}")
    if stats.finished and stats.error_rate > replay.max_error_rate:
        raise AgentabError(
            f"run failed: error rate {stats.error_rate:.1%} ({stats.errors} of {stats.finished} "
            f"requests) exceeds max_error_rate {replay.max_error_rate:.1%}; top errors: "
            f"{stats.top_errors()}; {where}"
        )


def replay_to_dir(
    workload: Workload,
    *,
    url: str | Sequence[str],
    replay: ReplayOptions,
    out_dir: str | Path,
    model: str | None = None,
    api_key_env: str | None = None,
    manifest_extra: dict[str, Any] | None = None,
    progress: bool = True,
) -> Path:
    """Replay against an OpenAI-compatible server at `url` on the real clock; several URLs are
    replicas of one server, each lane pinned to one of them (`agentab.replay.targets.routed`)."""
    from agentab.replay.targets.http import api_key_from_env
    from agentab.replay.targets.routed import routed_target

    urls = target_urls(url, api_key_env)
    target = routed_target(
        urls,
        model=model,
        endpoint=replay.endpoint,
        api_key=api_key_from_env(api_key_env),
        timeout_s=replay.request_timeout_s,
    )
    return run_to_dir(
        workload,
        target,
        replay=replay,
        out_dir=out_dir,
        virtual=False,
        manifest_extra=manifest_extra,
        progress=progress,
        label="replay",
    )


def target_urls(url: str | Sequence[str], api_key_env: str | None) -> tuple[str, ...]:
    """The replay's URLs as a tuple (one or several replicas); a URL with credentials is refused
    beside --api-key-env, which would send a key too."""
    urls = (url,) if isinstance(url, str) else tuple(url)
    if not urls:
        raise AgentabError("--url: give at least one server URL")
    for u in urls:
        if api_key_env and has_credentials(u):
            raise AgentabError(
                f"--url {redact_url(u)}: carries credentials (user:password@) and --api-key-env "
                f"{api_key_env} sends a key too; give the server one of them"
            )
    return urls


def simulate_to_dir(
    workload: Workload,
    *,
    engine_options: SimulatorOptions | Mapping[str, Any],
    replay: ReplayOptions,
    out_dir: str | Path,
    manifest_extra: dict[str, Any] | None = None,
    progress: bool = True,
) -> Path:
    """Replay against the in-process simulator on the virtual clock.

    `engine_options`: `agentab.engine.options.SimulatorOptions`, or a mapping of its fields
    (`profile` required, `decode_backend` default "auto").
    """
    from agentab.engine.executor import SimExecutor
    from agentab.engine.options import SimulatorOptions, decode_options
    from agentab.engine.sim import simulator_from
    from agentab.replay.targets.engine import EngineTarget

    if not isinstance(engine_options, SimulatorOptions):
        engine_options = decode_options(SimulatorOptions, engine_options)
    engine = simulator_from(engine_options)
    assert isinstance(engine.executor, SimExecutor)  # what simulator_from builds
    prof = engine.executor.profile
    target = EngineTarget(
        engine,
        intake_s=prof.frontend_intake_us * 1e-6,
        output_s=prof.frontend_output_us * 1e-6,
    )
    return run_to_dir(
        workload,
        target,
        replay=replay,
        out_dir=out_dir,
        virtual=True,
        manifest_extra=manifest_extra,
        progress=progress,
        label="simulate",
    )
