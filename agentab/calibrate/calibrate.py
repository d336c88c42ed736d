"""`calibrate`: time the load on one or two servers, fit, and write the profile.

The standard path (and prefill, and the KV term) is timed on a server running
`decode_backend auto`; the latency_specialized path, when wanted, on a second server running
that backend, with batches the path serves. For the local engine the servers are launched
here, one per backend, and stopped after their load.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from agentab.calibrate.client import Measurements, run_load
from agentab.calibrate.facts import EngineFacts, engine_facts, local_engine_schedules_ahead
from agentab.calibrate.fit import DRAFTER, fit_all
from agentab.calibrate.load import CalibrationLoad, build_load
from agentab.calibrate.write import (
    SPECIALIZED_MAX_PADDED,
    Provenance,
    fit_report,
    render_profile,
    unidentified_fields,
    write_outputs,
    write_report,
)
from agentab.clock import run_real
from agentab.engine.options import DecodeBackend
from agentab.errors import AgentabError
from agentab.redact import redact_url

DEFAULT_MAX_MODEL_LEN = 4096  # the load's own cap when a server states none


def fresh_seed() -> int:
    """A seed no earlier run is likely to have used: a server keeps the prompts of every
    calibration it served in its prefix cache, and a load that repeats them times cached
    prompts as if they were computed (the prefill points collapse to the uncached tail)."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class CalibrateRequest:
    out: Path
    name: str
    urls: dict[str, str]  # decode path -> server URL (empty when local servers are launched)
    local: dict[str, Any] | None  # local-engine options when the servers are launched here
    local_paths: tuple[str, ...]
    timing: str  # auto | client | engine
    batches: tuple[int, ...]
    contexts: tuple[int, int] | None
    steps: int
    prefill_repeats: int
    seed: int | None  # None: a fresh seed for this run (fresh_seed)
    gpu_count: int | None
    tp: int | None
    allow_assumed: tuple[str, ...]
    model: str | None
    command: str
    # local engine: time only these servers (standard, specialized, drafter) and write their
    # measurements without a fit, so a calibration longer than one sitting (one device call)
    # runs in parts that `--refit A.fit.json --refit B.fit.json` fits together
    only: tuple[str, ...] | None = None
    # --refit: fit parts timed on different engine code (the provenance names each one's)
    allow_engine_change: bool = False
    # the engine's prefill graph sizes, where its description (or a refitted report) lacks them
    prefill_graph_tokens: tuple[int, ...] | None = None


def calibrate(
    req: CalibrateRequest, echo: Callable[[str], None], warn: Callable[[str], None]
) -> tuple[Path, Path, str]:
    """Time, fit, write; returns (profile path, report path, one-line summary)."""
    measured: dict[str, Measurements] = {}
    facts: dict[str, EngineFacts] = {}
    loads: dict[str, CalibrationLoad] = {}
    timing = req.timing
    if req.seed is None:
        req = replace(req, seed=fresh_seed())
    for path, url in _servers(req):
        f = engine_facts(url)
        _check_backend(path, f, url)
        _check_same_engine(path, f, facts)
        if timing == "auto":
            timing = "engine" if f.engine_clock else "client"
        if timing == "engine" and not f.engine_clock:
            raise AgentabError(
                f"--timing engine: {url} exports no step timings (agentab:step_seconds_*_total "
                "or vLLM's inter-token histograms); use --timing client"
            )
        load = _load_for(
            req, path, f, one_prefill_step=timing == "engine" and f.engine_clock == "vllm"
        )
        what = "drafter (speculative decoding)" if path == DRAFTER else f"{path} path"
        echo(
            f"agentab calibrate: {what} on {f.engine} {f.version or ''} at {redact_url(url)} "
            f"({timing} timing): {len(load.decode)} decode phases, "
            f"{len(load.prefill)} prefill requests, {len(load.mixed)} mixed phases"
        )
        if path == "standard" and not load.mixed:
            echo(
                "  vLLM's clock cannot time one step while others stream: no mixed phase "
                "(--timing client times one)"
            )

        def progress(i: int, n: int, what: str, path: str = path) -> None:
            echo(f"  [{path} {i}/{n}] {what}")

        measured[path] = run_real(
            run_load(
                url,
                load,
                model=req.model,
                engine_clock=f.engine_clock if timing == "engine" else None,
                progress=progress,
                warn=warn,
                mixed_rows="verify" if path == DRAFTER else "decode",
            )
        )
        facts[path] = f
        loads[path] = load
    described = {p: load.describe() for p, load in loads.items()}
    if DRAFTER in described:  # its verify steps' query length, for the fit (and --refit)
        described[DRAFTER]["draft_tokens"] = _draft_tokens(req)
    if req.only is not None:
        report = _report_skeleton(_provenance(req, facts, timing), facts, described, timing)
        kept = write_report(req.out, _with_measurements(report, measured, None))
        return (
            kept,
            kept,
            f"measurements of {', '.join(measured)} only, no profile: fit the parts together "
            f"with `agentab calibrate --refit {kept} --refit OTHER.fit.json -o PROFILE.toml`",
        )
    return fit_and_write(req, measured, facts, described, timing)


def _provenance(
    req: CalibrateRequest,
    facts: dict[str, EngineFacts],
    timing: str,
    refit_of: dict[str, Any] | None = None,
) -> Provenance:
    std = facts.get("standard") or next(iter(facts.values()))
    return Provenance(
        engine=std.engine,
        version=std.version,
        device=std.device,
        model=std.model,
        url=std.url,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=req.command
        if refit_of is None
        else f"{req.command}  # refit of the measurements of {refit_of.get('date')}: "
        f"{refit_of.get('command')}",
        timing=timing,
        urls={p: f.url for p, f in facts.items()},
        engine_source=_engine_source(facts),
    )


def _report_skeleton(
    provenance: Provenance,
    facts: dict[str, EngineFacts],
    loads: dict[str, dict[str, Any]],
    timing: str,
) -> dict[str, Any]:
    """What --refit reads back (provenance, facts, load, clock); a fit's parts join it."""
    return {
        "provenance": asdict(provenance),
        "engine": {path: f.to_dict() for path, f in facts.items()},
        "load": loads,
        "timing": timing,
    }


def _with_graph_tokens(std: EngineFacts, stated: tuple[int, ...] | None) -> EngineFacts:
    """The standard server's facts with the prefill graph sizes the user stated
    (--prefill-graph-tokens), which must agree with the engine's own where it described them."""
    if stated is None:
        return std
    if any(b <= a for a, b in itertools.pairwise(stated)):
        raise AgentabError(f"--prefill-graph-tokens {list(stated)}: must be strictly increasing")
    described = std.prefill_graph_tokens
    if described is not None:  # the engine's word stands; the statement must agree with it
        if list(described) != list(stated):
            raise AgentabError(
                f"--prefill-graph-tokens {list(stated)}: the engine describes {list(described)}"
            )
        return std
    sources = {**std.sources, "prefill_graph_tokens": "--prefill-graph-tokens"}
    return replace(std, prefill_graph_tokens=list(stated), sources=sources)


def fit_and_write(
    req: CalibrateRequest,
    measured: dict[str, Measurements],
    facts: dict[str, EngineFacts],
    loads: dict[str, dict[str, Any]],
    timing: str,
    refit_of: dict[str, Any] | None = None,
) -> tuple[Path, Path, str]:
    """Fit the measurements and write the profile and its report. `refit_of`: the provenance
    of the report whose measurements these are, when they are fitted again (`--refit`)."""
    std = _with_graph_tokens(facts["standard"], req.prefill_graph_tokens)
    if "specialized" in measured:  # prefill and KV come from the standard server only
        measured["specialized"] = replace(measured["specialized"], prefill=[])
    provenance = _provenance(req, facts, timing, refit_of)
    report = _report_skeleton(provenance, facts, loads, timing)
    try:
        fit = fit_all(
            measured,
            timing=timing,
            graph_max=std.cuda_graph_max_tokens or 1,
            max_num_batched_tokens=std.max_num_batched_tokens or 10**9,
            draft_tokens=_loaded_draft_tokens(loads),
            graph_tokens=tuple(std.prefill_graph_tokens or ()),
        )
        kv_blocks, kv_tag = _capacity(std, measured["standard"])
        gpu_count = req.gpu_count or std.gpu_count
        gpu_tag = "[U]" if req.gpu_count else "[E]"
        facts_for_missing = replace(std, gpu_count=gpu_count)
        missing = unidentified_fields(fit, facts_for_missing, kv_blocks)
        scheduler = {
            "max_num_seqs": std.max_num_seqs,
            "max_num_batched_tokens": std.max_num_batched_tokens,
            "block_size": std.block_size,
            "kv_blocks": kv_blocks,
        }
        report = fit_report(fit, facts, provenance, loads, missing, scheduler)
        text = render_profile(
            name=req.name,
            fit=fit,
            facts=facts_for_missing,
            provenance=provenance,
            kv_blocks=kv_blocks,
            kv_blocks_tag=kv_tag,
            gpu_count=gpu_count,
            gpu_tag=gpu_tag,
            tp=req.tp or std.tp,
            allowed=req.allow_assumed,
        )
    except AgentabError as exc:  # the minutes of timing are not lost with the profile
        kept = req.out.with_suffix(".fit.json")
        if refit_of is None or Path(refit_of["report"]).resolve() != kept.resolve():
            write_report(req.out, _with_measurements(report, measured, refit_of))
        raise AgentabError(
            f"{exc}; no profile written, the measurements are kept in {kept} "
            f"(`agentab calibrate --refit {kept} -o {req.out}` fits them again)"
        ) from None
    report = _with_measurements(report, measured, refit_of)
    profile_path, report_path = write_outputs(req.out, text, report)
    return profile_path, report_path, _summary(fit)


def _with_measurements(
    report: dict[str, Any], measured: dict[str, Measurements], refit_of: dict[str, Any] | None
) -> dict[str, Any]:
    if refit_of is not None:
        report["refit_of"] = refit_of
    report["measurements"] = dict(measured)
    return report


def refit(req: CalibrateRequest, report_paths: Sequence[Path]) -> tuple[Path, Path, str]:
    """Fit fit reports' recorded measurements again (after the fit or the model changed),
    without timing anything: the facts, load and clock are the reports'. Several reports are
    parts of one calibration (`--only`, e.g. one device call each): each path's measurements
    come from one of them, and all must have timed the same engine code on the same clock."""
    measured: dict[str, Measurements] = {}
    facts: dict[str, EngineFacts] = {}
    loads: dict[str, Any] = {}
    timings: set[str] = set()
    provenance: dict[str, Any] = {}
    for report_path in report_paths:
        part = _read_report(report_path)
        for path in part["measured"]:
            if path in measured:
                raise AgentabError(
                    f"--refit {report_path}: the {path} path is measured in an earlier report too; "
                    "give each path's measurements once"
                )
            if not req.allow_engine_change:
                _check_same_engine(path, part["facts"][path], facts, refit=True)
        measured.update(part["measured"])
        facts.update(part["facts"])
        loads.update(part["loads"])
        timings.add(part["timing"])
        provenance = provenance or part["provenance"]
    if len(timings) > 1:
        raise AgentabError(f"--refit: the reports timed on different clocks ({sorted(timings)})")
    if "standard" not in measured or "standard" not in facts:
        raise AgentabError(
            f"--refit {', '.join(map(str, report_paths))}: no standard-path measurements"
        )
    refit_of = {"report": str(report_paths[0]), **provenance}
    if len(report_paths) > 1:
        refit_of["parts"] = [str(p) for p in report_paths]
    return fit_and_write(req, measured, facts, loads, timings.pop(), refit_of=refit_of)


def _read_report(report_path: Path) -> dict[str, Any]:
    """A fit report's measurements, facts, load, clock and provenance."""
    from agentab.calibrate.client import DecodeMeasurement, MixedMeasurement, PrefillMeasurement

    try:
        report = json.loads(report_path.read_text())
        measured = {
            path: Measurements(
                decode=[DecodeMeasurement(**row) for row in m["decode"]],
                prefill=[PrefillMeasurement(**row) for row in m["prefill"]],
                mixed=[MixedMeasurement(**row) for row in m.get("mixed", [])],
            )
            for path, m in report["measurements"].items()
        }
        facts = {path: EngineFacts(**f) for path, f in report["engine"].items()}
        for f in facts.values():
            local_engine_schedules_ahead(f)
        return {
            "measured": measured,
            "facts": facts,
            "loads": report["load"],
            "timing": report["timing"],
            "provenance": report["provenance"],
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AgentabError(f"--refit {report_path}: not a calibration fit report ({exc})") from None


def _servers(req: CalibrateRequest) -> Iterator[tuple[str, str]]:
    if req.local is None:
        yield from req.urls.items()
        return
    import tempfile

    from agentab.engine.local.launch import launched_local_server

    # the decode paths are timed without drafts (a verify step is a decode step of its padded
    # token count: the same tables price it); with a speculative config, its drafter after.
    # The draft-free servers then hold max_num_seqs x (1 + k) sequences, so their decode
    # batches reach the token counts of the engine's verify steps: the same graphs, which the
    # engine with drafts captures up to that count too.
    plain = {k: v for k, v in req.local.items() if k != "speculative_config"}
    spec = req.local.get("speculative_config")
    drafting = spec is not None
    if drafting and plain.get("max_num_seqs"):
        plain["max_num_seqs"] = int(plain["max_num_seqs"]) * (1 + _draft_tokens(req))
    for path in (*req.local_paths, *((DRAFTER,) if drafting else ())):
        if req.only is not None and path not in req.only:
            continue
        backend = backend_timing(path)
        options = req.local if path == DRAFTER else plain
        with (
            tempfile.TemporaryDirectory(prefix="agentab-calibrate-") as log_dir,
            _launched(launched_local_server, options, backend, Path(log_dir)) as url,
        ):
            yield path, url


@contextmanager
def _launched(launcher: Any, options: dict[str, Any], backend: str, log_dir: Path) -> Iterator[str]:
    with launcher(options, decode_backend=backend, log_dir=log_dir) as server:
        yield server.url


def backend_timing(path: str) -> DecodeBackend:
    """The decode backend of the server a decode path is timed on: `auto` runs every step
    standard; `latency_specialized` runs the pure-decode batches the specialized path takes.
    The drafter runs the standard path in both arms: timed under `auto`."""
    if path in ("standard", DRAFTER):
        return DecodeBackend.AUTO
    return DecodeBackend.LATENCY_SPECIALIZED


def _check_backend(path: str, f: EngineFacts, url: str) -> None:
    want = backend_timing(path).value
    if f.decode_backend is not None and f.decode_backend != want:
        flag = "--url" if path == "standard" else "--specialized-url"
        raise AgentabError(
            f"{flag} {url}: the server runs decode_backend {f.decode_backend!r}; the {path} "
            f"path is timed on a server running {want!r}"
        )


def _check_same_engine(
    path: str, f: EngineFacts, timed: dict[str, EngineFacts], *, refit: bool = False
) -> None:
    """Both decode paths of one profile must be timed on the same engine code."""
    for other, g in timed.items():
        if f.engine_source and g.engine_source and f.engine_source != g.engine_source:
            hint = (
                " (--allow-engine-change fits them anyway, for a change that leaves the steps' "
                "time alone)"
                if refit
                else ""
            )
            raise AgentabError(
                f"the {path} path's server ({f.url}) runs engine source {f.engine_source}, the "
                f"{other} path's ({g.url}) {g.engine_source}: a profile describes one engine" + hint
            )


def _engine_source(facts: dict[str, EngineFacts]) -> str | None:
    """The engine source the profile was timed on: one digest, or (parts fitted across an
    engine change) each path's, so that the profile and `agentab fidelity` show the mix."""
    sources = {path: f.engine_source for path, f in facts.items() if f.engine_source}
    if len(set(sources.values())) <= 1:
        return next(iter(sources.values()), None)
    return ", ".join(f"{path} {source}" for path, source in sources.items())


def _load_for(
    req: CalibrateRequest, path: str, f: EngineFacts, *, one_prefill_step: bool
) -> CalibrationLoad:
    assert req.seed is not None, "calibrate() chooses the seed before the first load"
    batches = req.batches
    steps = req.steps
    if path == "specialized":  # only the batches the path serves (pure decode, q = 1)
        batches = tuple(b for b in batches if b <= specialized_limit(f))
    if path == DRAFTER:  # every step emits up to 1 + k tokens a row: as many steps need more
        steps = req.steps * (1 + _draft_tokens(req))
        if f.max_num_seqs is not None:
            batches = tuple(b for b in batches if b <= f.max_num_seqs)
    if f.max_num_seqs is not None and batches[-1] > f.max_num_seqs:
        raise AgentabError(
            f"--batches: {batches[-1]} exceeds the server's max_num_seqs {f.max_num_seqs}"
        )
    load = build_load(
        batches=batches,
        contexts=req.contexts,
        steps=steps,
        max_model_len=f.max_model_len or DEFAULT_MAX_MODEL_LEN,
        block_size=f.block_size or 16,
        max_num_batched_tokens=f.max_num_batched_tokens,
        max_num_seqs=f.max_num_seqs,
        prefill_repeats=req.prefill_repeats if path == "standard" else 0,
        seed=req.seed,
        one_prefill_step=one_prefill_step,
        # vLLM's histograms cannot single out the one step a mixed phase times: its /metrics
        # answers late while it streams, so the prompt cannot be sent between two reads.
        # The drafter's mixed phases time verify rows beside a prompt (fit.fit_mixed_verify)
        with_mixed=not one_prefill_step,
        mixed_repeats=req.prefill_repeats if path == DRAFTER else None,
        draft_tokens=_draft_tokens(req) if path == DRAFTER else 0,
    )
    if f.kv_blocks and f.block_size:
        need = max(p.batch * math.ceil((p.context + p.steps) / f.block_size) for p in load.decode)
        if need > f.kv_blocks:
            raise AgentabError(
                f"the largest decode phase needs {need} KV blocks, the server has {f.kv_blocks}: "
                "lower --batches or --contexts"
            )
    return load


def specialized_limit(f: EngineFacts) -> int:
    """The largest step the server's specialized path serves: the path's own limit, or the
    engine's `specialized_max_tokens` below it, above which the engine runs a step on the
    standard path (a decode phase there would time the standard path into the specialized
    table). The simulator routes those steps standard by the same option."""
    stated = f.raw.get("specialized_max_tokens")
    if isinstance(stated, int) and not isinstance(stated, bool) and stated >= 1:
        return min(SPECIALIZED_MAX_PADDED, stated)
    return SPECIALIZED_MAX_PADDED


def _loaded_draft_tokens(loads: dict[str, dict[str, Any]]) -> int:
    """k of the server that drafted, as its load records it (0 without one). A report written
    before the load recorded it gives k by the drafter phases' step count, which `_load_for`
    sets to (1 + k) times the decode paths'."""
    drafter = loads.get(DRAFTER)
    if not drafter:
        return 0
    if "draft_tokens" in drafter:
        return int(drafter["draft_tokens"])
    try:
        steps = drafter["decode"][0][2] / loads["standard"]["decode"][0][2]
    except (KeyError, IndexError, TypeError, ZeroDivisionError):
        return 0
    return max(round(steps) - 1, 0)


def _draft_tokens(req: CalibrateRequest) -> int:
    """k of the local engine's speculative config (0 without one)."""
    spec = (req.local or {}).get("speculative_config") or {}
    return int(spec.get("num_speculative_tokens", 0))


def _capacity(f: EngineFacts, m: Measurements) -> tuple[int | None, str]:
    """KV capacity: as the engine states it, else from its usage gauge under a known load."""
    if f.kv_blocks:
        return f.kv_blocks, f"[E] {f.sources.get('kv_blocks', '')}".strip()
    seen = [r for r in m.decode if r.kv_usage and r.kv_tokens]
    if not seen or f.block_size is None:
        return None, ""
    r = max(seen, key=lambda r: r.kv_usage or 0.0)
    assert r.kv_usage and r.kv_tokens
    blocks = r.kv_tokens / f.block_size + r.batch / 2  # each row's last block is partly full
    return round(blocks / r.kv_usage), "[C] from vllm:kv_cache_usage_perc under the load"


def _summary(fit: Any) -> str:
    parts = []
    for path, d in fit.decode.items():
        worst = max(abs(r["error"]) for r in d.residuals)
        parts.append(
            f"decode {path}: {len(d.batch_tokens)} batch points, max |residual| {worst:.1%}"
        )
    if fit.prefill is not None:
        worst = max(abs(r["error"]) for r in fit.prefill.residuals)
        parts.append(f"prefill: max |residual| {worst:.1%}")
    if fit.mixed is not None:
        worst = max(abs(r["error"]) for r in fit.mixed.residuals)
        parts.append(
            f"mixed: {fit.mixed.us_per_decode_row.value / 1e3:.3g} ms per decode row, "
            f"max |residual| {worst:.1%}"
        )
    if fit.drafter is not None:
        d = fit.drafter
        step, row = d.step_us.value, d.row_us.value
        parts.append(f"drafter: {step:.4g} us per step + {row:.4g} us per row")
        if d.verify_context_us is not None:
            worst = max(abs(r["error"]) for r in d.verify_residuals)
            parts.append(
                f"verify: {d.verify_context_us.value:.4g} us per context token per draft token, "
                f"max |residual| {worst:.1%}"
            )
        if d.mixed_verify is not None:
            worst = max(abs(r["error"]) for r in d.mixed_verify.residuals)
            parts.append(
                f"mixed verify: {d.mixed_verify.us_per_decode_row.value:.4g} us per verify row, "
                f"max |residual| {worst:.1%}"
            )
    return "; ".join(parts)
