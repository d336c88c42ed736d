"""Send the calibration load to a server over HTTP and time it.

Two clocks time each phase:
- the client's: when every streamed chunk arrived and how many tokens it carried
  (`return_token_ids`, which vLLM and agentab's servers honour), so chunks that a busy
  frontend coalesces still count every step;
- the engine's own, when it exports agentab's step counters (`agentab:step_seconds_*_total`
  and `agentab:steps_*_total` on /metrics): /metrics is polled during each phase and the
  counter increase between two polls inside the phase's steady window is the time of exactly
  the steps that ran there, with no HTTP or streaming time in it.
Requests reuse the replay client (`HttpTarget`): the same connection handling, stream parsing
and error classes as a replay run, so a failure here reads like one there.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from agentab.calibrate.facts import (
    DECODE_STEPS,
    DRAFT_SECONDS,
    DRAFT_STEPS,
    STEP_SECONDS,
    STEPS,
    VLLM_ITL,
    VLLM_PREFILL,
    VLLM_STEP_TOKENS,
)
from agentab.calibrate.load import (
    CalibrationLoad,
    DecodePhase,
    MixedPhase,
    PrefillPhase,
    unique_prompts,
)
from agentab.engine.profile import PATHS
from agentab.engine.request_metrics import BREAKDOWN
from agentab.errors import AgentabError
from agentab.replay.targets.base import Outcome
from agentab.replay.targets.http import HttpTarget

MIN_WINDOW_STEPS = 8
PHASE_ATTEMPTS = 3


class PhaseUnusable(AgentabError):
    """A phase whose timing cannot be read (too few steps with every request decoding), or
    can be read only with a known flaw (`measurement`: kept if no attempt does better)."""

    def __init__(self, message: str, *, measurement: Any = None) -> None:
        super().__init__(message)
        self.measurement = measurement


@dataclass(frozen=True)
class LoadRequest:
    """What `HttpTarget.send` reads of a request, with the prompt given as ids."""

    request_id: str
    prompt: list[int]
    max_tokens: int


class CalibrationTarget(HttpTarget):
    """The replay client with explicit prompt ids and per-chunk token ids asked for."""

    def _body(self, spec: Any) -> bytes:
        return orjson.dumps(
            {
                "model": self.model,
                "prompt": spec.prompt,
                "max_tokens": spec.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
                "return_token_ids": True,
            }
        )


@dataclass
class DecodeMeasurement:
    batch: int
    context: int  # prompt tokens per request
    window_steps: int  # decode steps inside the steady window (client count)
    context_tokens: float  # sum over the rows of their context, mid-window
    client_step_s: float  # median over requests of window time / window tokens
    engine_step_s: float | None = None  # counter increase / decode steps, when exported
    engine_steps: int | None = None
    engine_path: str | None = None
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc mid-window, when exported
    kv_tokens: float | None = None  # tokens held in the cache at that sample
    window_steps_requested: int = 0  # max_tokens per request
    # a server that drafts (speculative decoding): its drafter's seconds per step that drafted,
    # and how many such steps (agentab:draft_device_seconds_total, agentab:draft_steps_total)
    engine_draft_s: float | None = None
    engine_draft_steps: int | None = None


@dataclass
class PrefillMeasurement:
    new: int
    cached: int  # as the server reported it (else as requested)
    ttft_s: float
    engine_s: float | None = None  # the request's standard-path step seconds, when exported
    engine_steps: int | None = None
    # the server's own split of this request's TTFT, when it exports per-request histograms
    # (agentab serve: agentab.engine.request_metrics): intake, queue, prefill, output seconds
    server_s: dict[str, float] | None = None


@dataclass
class MixedMeasurement:
    rows: int  # decode rows beside the prompt
    new: int  # prompt tokens computed in the step
    context_tokens: float  # the decode rows' attended context in that step (sum over rows)
    client_s: float  # median over the decode rows of their gap that ends with the step
    engine_s: float | None = None  # the step's time on agentab's step counters, when exported
    decode_step_s: float | None = None  # the decode steps' time subtracted from the counters


@dataclass
class Measurements:
    decode: list[DecodeMeasurement] = field(default_factory=list)
    prefill: list[PrefillMeasurement] = field(default_factory=list)
    mixed: list[MixedMeasurement] = field(default_factory=list)


Sample = tuple[float, dict[str, float]]  # (loop time, metric name -> value summed over labels)


async def run_load(
    url: str,
    load: CalibrationLoad,
    *,
    model: str | None = None,
    engine_clock: str | None,
    scrape_interval_s: float = 0.02,
    vocab_size: int = 32000,
    progress: Any = None,
    warn: Any = None,
    mixed_rows: str = "decode",
) -> Measurements:
    """Run every phase of `load` against `url` (real clock) and return what was measured.

    `mixed_rows` names a mixed phase's rows in the progress lines: "verify" on a server that
    drafts, whose decode rows verify 1 + k tokens each."""
    target = CalibrationTarget(url, model=model, timeout_s=600.0)
    await target.start()
    rng = np.random.default_rng(load.seed)
    out = Measurements()
    ids = iter(range(10**9))

    def rid(kind: str) -> str:
        return f"calibrate-{kind}-{next(ids)}"

    try:
        # warm up what a first use pays for (allocations, kernels picked per shape): the
        # largest decode batch for a whole phase, and the longest prefill
        biggest = max(load.decode, key=lambda p: (p.batch, p.context))
        warm = unique_prompts(rng, biggest.batch, biggest.context, vocab_size)
        warmed = await asyncio.gather(
            *(_send(target, LoadRequest(rid("warmup"), p.tolist(), biggest.steps)) for p in warm)
        )
        _check_prompts_fresh(url, load.seed, warmed, biggest.context)
        if load.prefill:
            longest = max(p.new + p.cached for p in load.prefill)
            prompt = unique_prompts(rng, 1, longest, vocab_size)[0].tolist()
            await _send(target, LoadRequest(rid("warmup"), prompt, 1))
        total = len(load.decode) + len(load.prefill) + len(load.mixed)
        for i, phase in enumerate(load.decode):
            m = await _decode_attempts(
                target, phase, rng, vocab_size, rid, engine_clock, scrape_interval_s, warn
            )
            out.decode.append(m)
            if progress:
                progress(i + 1, total, f"decode batch {phase.batch} context {phase.context}")
        for j, pre in enumerate(load.prefill):
            p = await _prefill_phase(target, pre, rng, vocab_size, engine_clock, rid)
            out.prefill.append(p)
            if progress:
                progress(len(load.decode) + j + 1, total, f"prefill {pre.new} after {pre.cached}")
        done = len(load.decode) + len(load.prefill)
        for j, mix in enumerate(load.mixed):
            out.mixed.append(await _mixed_attempts(target, mix, rng, vocab_size, rid, engine_clock))
            if progress:
                what = f"mixed {mix.new} beside {mix.rows} {mixed_rows} rows"
                progress(done + j + 1, total, what)
    finally:
        await target.close()
    return out


def _check_prompts_fresh(url: str, seed: int, warmed: list[Outcome], length: int) -> None:
    """Refuse a load whose prompts the server has cached already: an earlier calibration with
    the same seed sent them, and every prefill point would time a cache hit (the fit would
    price prefill as its fixed cost alone). The warm-up is the load's first request, so this
    costs no measured phase."""
    cached = max((o.cached_tokens or 0) for o in warmed)
    if cached > 0:
        raise AgentabError(
            f"{url}: the server's prefix cache already holds the prompts of calibration seed "
            f"{seed} ({cached} of a warm-up prompt's {length} tokens were cached): an earlier "
            "calibration sent them; leave --seed out (a fresh seed each run) or restart the server"
        )


async def _decode_attempts(
    target: HttpTarget,
    phase: DecodePhase,
    rng: np.random.Generator,
    vocab: int,
    rid: Any,
    engine_clock: str | None,
    interval: float,
    warn: Any,
) -> DecodeMeasurement:
    """Run a decode phase up to PHASE_ATTEMPTS times on new prompts until it reads cleanly.

    A host stall can deliver a whole stream in one read, or a frontend admit the requests
    one by one; such a phase says little about the step time, so it is run again. When every
    attempt has a known flaw, the least flawed is kept and a warning says so."""
    flawed: list[PhaseUnusable] = []
    for _ in range(PHASE_ATTEMPTS):
        prompts = unique_prompts(rng, phase.batch, phase.context, vocab)
        reqs = [LoadRequest(rid("decode"), p.tolist(), phase.steps) for p in prompts]
        try:
            return await _decode_phase(target, phase, reqs, engine_clock, interval)
        except PhaseUnusable as exc:
            flawed.append(exc)
    kept = [e.measurement for e in flawed if e.measurement is not None]
    if not kept:
        raise flawed[-1]
    best = min(kept, key=lambda m: m.engine_steps or 0)
    if warn is not None:
        warn(
            f"decode phase (batch {phase.batch}, context {phase.context}): admission spread "
            f"in all {PHASE_ATTEMPTS} attempts; keeping the least spread ({best.engine_steps} "
            f"steps for {phase.steps} tokens per request)"
        )
    return best


async def _send(target: HttpTarget, req: LoadRequest, out: Outcome | None = None) -> Outcome:
    """Send and wait for the whole response; `out` may be watched while it streams."""
    out = Outcome() if out is None else out
    await target.send(req, out)  # type: ignore[arg-type]
    if out.error_class is not None:
        raise AgentabError(
            f"calibration request {req.request_id} ({len(req.prompt)} prompt tokens, "
            f"max_tokens {req.max_tokens}) failed: {out.error_class}: {out.error_message}"
        )
    return out


async def _scrape(target: HttpTarget) -> Sample:
    loop = asyncio.get_running_loop()
    t = loop.time()
    values: dict[str, float] = {}
    for name, _labels, value in await target.scrape():
        values[name] = values.get(name, 0.0) + value
    return t, values


async def _poll(target: HttpTarget, samples: list[Sample], stop: asyncio.Event, every: float):
    while not stop.is_set():
        samples.append(await _scrape(target))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def _decode_phase(
    target: HttpTarget,
    phase: DecodePhase,
    reqs: list[LoadRequest],
    engine_clock: str | None,
    interval: float,
) -> DecodeMeasurement:
    samples: list[Sample] = []
    if engine_clock == "vllm":  # its /metrics stalls while it streams: read it around the phase
        samples.append(await _scrape(target))
        outs = await asyncio.gather(*(_send(target, r) for r in reqs))
        samples.append(await _scrape(target))
    else:
        stop = asyncio.Event()
        poller = asyncio.ensure_future(_poll(target, samples, stop, interval))
        try:
            outs = await asyncio.gather(*(_send(target, r) for r in reqs))
        finally:
            stop.set()
            await poller
    where = f"decode phase (batch {phase.batch}, context {phase.context})"
    series = [_token_series(o, where) for o in outs]
    start = max(t[0] for t, _ in series)
    end = min(t[-1] for t, _ in series)
    rates, mids = [], []
    for t, k in series:
        inside = (t >= start) & (t <= end)
        if inside.sum() >= 3 and k[inside][-1] > k[inside][0]:
            # seconds per token: the least-squares slope of arrival time over tokens, so one
            # late or coalesced chunk moves it less than it moves the window's two ends
            rates.append(float(np.polyfit(k[inside], t[inside], 1)[0]))
        mids.append(float(np.interp((start + end) / 2, t, k)))
    window = int(min(np.interp(end, t, k) - np.interp(start, t, k) for t, k in series))
    if engine_clock != "vllm" and (not rates or window < MIN_WINDOW_STEPS):
        raise PhaseUnusable(
            f"{where}: only {window} steps had every request decoding (need "
            f"{MIN_WINDOW_STEPS}); raise --steps or lower the largest batch"
        )
    if engine_clock == "vllm":  # the whole phase: every row from its prompt to its end
        mids = [phase.steps / 2] * len(reqs)
    context = float(sum(len(r.prompt) for r in reqs) + sum(mids))
    m = DecodeMeasurement(
        batch=phase.batch,
        context=phase.context,
        window_steps=window,
        context_tokens=context,
        client_step_s=float(np.median(rates)) if rates else float("nan"),
        window_steps_requested=phase.steps,
    )
    inside = [s for s in samples if start <= s[0] <= end]
    if inside:
        mid = inside[len(inside) // 2]
        usage = mid[1].get("vllm:kv_cache_usage_perc")
        if usage:
            m.kv_usage = usage
            held = [
                len(r.prompt) + np.interp(mid[0], t, k)
                for r, (t, k) in zip(reqs, series, strict=True)
            ]
            m.kv_tokens = float(sum(held))
    if engine_clock == "agentab":
        _engine_decode(m, inside, where)
    elif engine_clock == "vllm":
        _vllm_decode(m, samples, where)
    return m


def _token_series(out: Outcome, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Absolute chunk arrival times and the cumulative tokens at each."""
    if out.chunk_tokens is None:
        raise AgentabError(
            f"{where}: the server did not return per-chunk token ids (return_token_ids); "
            "calibration needs them to count the steps between chunks"
        )
    assert out.sent is not None
    t = out.sent + np.asarray(out.chunk_times, dtype=np.float64)
    k = np.cumsum(np.asarray(out.chunk_tokens, dtype=np.float64))
    return t, k


def _engine_decode(m: DecodeMeasurement, inside: list[Sample], where: str) -> None:
    if len(inside) < 2:
        raise PhaseUnusable(
            f"{where}: fewer than two /metrics polls fell inside the steady window; "
            "raise --steps (or use --timing client)"
        )
    (_, a), (_, b) = inside[0], inside[-1]

    def delta(name: str) -> float:
        return b.get(name, 0.0) - a.get(name, 0.0)

    all_steps = sum(delta(STEPS.format(path=p)) for p in PATHS)
    for path in PATHS:
        n = delta(DECODE_STEPS.format(path=path))
        if n and n == all_steps:
            m.engine_path = path
            m.engine_steps = int(n)
            m.engine_step_s = delta(STEP_SECONDS.format(path=path)) / n
            break
    if m.engine_steps is None or m.engine_steps < MIN_WINDOW_STEPS:
        raise PhaseUnusable(
            f"{where}: the engine's counters show {int(all_steps)} steps between the polls, "
            f"not {MIN_WINDOW_STEPS}+ pure decode steps on one path; raise --steps"
        )
    drafted = delta(DRAFT_STEPS)
    if drafted:
        m.engine_draft_steps = int(drafted)
        m.engine_draft_s = delta(DRAFT_SECONDS) / drafted


def _vllm_decode(m: DecodeMeasurement, samples: list[Sample], where: str) -> None:
    """Step time from vLLM's engine-core timestamps, read before and after the phase.

    The phase's prompts fit one step's token budget (`load.build_load`), so once admitted the
    requests decode in lockstep and their inter-token gaps are decode steps of `batch` rows.
    A frontend that takes the requests in one by one spreads their admission over several
    steps, with fewer (cheaper) rows while the last ones join; the spread is recorded
    (`engine_steps` less the tokens per request) and a spread above a tenth of the steps makes
    the phase a candidate for another attempt. The client's clock, which a starved frontend
    bunches, is not used.
    """
    (_, a), (_, b) = samples[0], samples[-1]

    def delta(name: str) -> float:
        return b.get(name, 0.0) - a.get(name, 0.0)

    steps = delta(f"{VLLM_STEP_TOKENS}_count")
    gaps = delta(f"{VLLM_ITL}_count")
    if not gaps:
        raise PhaseUnusable(f"{where}: the engine recorded no inter-token gaps")
    m.engine_step_s = delta(f"{VLLM_ITL}_sum") / gaps
    m.engine_steps = int(steps)
    m.engine_path = "standard"
    expected = m.window_steps_requested
    if steps > expected * 1.1 + 1:
        raise PhaseUnusable(
            f"{where}: the engine ran {int(steps)} steps for {expected} tokens per request "
            "(admission spread over many steps)",
            measurement=m,
        )


async def _prefill_phase(
    target: HttpTarget,
    pre: PrefillPhase,
    rng: np.random.Generator,
    vocab: int,
    engine_clock: str | None,
    rid: Any,
) -> PrefillMeasurement:
    prefix = unique_prompts(rng, 1, pre.cached, vocab)[0].tolist() if pre.cached else []
    if prefix:  # leave the prefix in the cache
        await _send(target, LoadRequest(rid("prefix"), prefix, 1))
    prompt = prefix + unique_prompts(rng, 1, pre.new, vocab)[0].tolist()
    before = await _scrape(target) if engine_clock else None
    out = await _send(target, LoadRequest(rid("prefill"), prompt, 1))
    after = await _scrape(target) if engine_clock else None
    cached = out.cached_tokens if out.cached_tokens is not None else pre.cached
    m = PrefillMeasurement(
        new=len(prompt) - cached, cached=cached, ttft_s=float(out.chunk_times[0])
    )
    if before is not None and after is not None:
        (_, a), (_, b) = before, after
        if engine_clock == "agentab":
            seconds, steps = STEP_SECONDS.format(path="standard"), STEPS.format(path="standard")
        else:  # scheduled to first token, engine-core timestamps
            seconds, steps = f"{VLLM_PREFILL}_sum", f"{VLLM_STEP_TOKENS}_count"
        m.engine_s = b.get(seconds, 0.0) - a.get(seconds, 0.0)
        m.engine_steps = int(b.get(steps, 0.0) - a.get(steps, 0.0))
        m.server_s = _server_split(a, b)
    return m


def _server_split(a: dict[str, float], b: dict[str, float]) -> dict[str, float] | None:
    """One request's intake, queue, prefill and output seconds from the server's histograms
    read before and after it (None unless each counted exactly that request)."""
    split = {}
    for part, name in zip(("intake", "queue", "prefill", "output"), BREAKDOWN, strict=True):
        if b.get(f"{name}_count", 0.0) - a.get(f"{name}_count", 0.0) != 1:
            return None
        split[part] = b[f"{name}_sum"] - a.get(f"{name}_sum", 0.0)
    return split


MIXED_LEAD = 4  # chunks every decode row has streamed before the decode-step window is timed


async def _mixed_attempts(
    target: HttpTarget,
    phase: MixedPhase,
    rng: np.random.Generator,
    vocab: int,
    rid: Any,
    engine_clock: str | None,
) -> MixedMeasurement:
    """Run a mixed phase up to PHASE_ATTEMPTS times on new prompts until it reads cleanly."""
    failed: PhaseUnusable | None = None
    for _ in range(PHASE_ATTEMPTS):
        try:
            return await _mixed_phase(target, phase, rng, vocab, rid, engine_clock)
        except PhaseUnusable as exc:
            failed = exc
    assert failed is not None
    raise failed


async def _until_chunks(outs: list[Outcome], chunks: int, tasks: list[asyncio.Task]) -> None:
    """Wait until every stream has received `chunks` chunks (or one has ended)."""
    while not all(len(o.chunk_times) >= chunks for o in outs):
        if any(t.done() for t in tasks):
            return
        await asyncio.sleep(0.0005)


async def _mixed_phase(
    target: HttpTarget,
    phase: MixedPhase,
    rng: np.random.Generator,
    vocab: int,
    rid: Any,
    engine_clock: str | None,
) -> MixedMeasurement:
    """`rows` decode requests; once they decode steadily, one prompt that fits one step.

    The step that computes the prompt is timed three ways: on the client, each decode row's
    gap between the chunk before that step and the chunk of that step (their median); on
    agentab's clock, the standard path's step seconds between a poll before the prompt was
    sent and one after its first token, less the decode steps among them at the decode step
    time of a window of the same rows just before. (vLLM's clock cannot: see load.py.)"""
    where = f"mixed phase ({phase.new} prompt tokens beside {phase.rows} decode rows)"
    prompts = unique_prompts(rng, phase.rows, phase.context, vocab)
    reqs = [LoadRequest(rid("mixed-decode"), p.tolist(), phase.steps) for p in prompts]
    outs = [Outcome() for _ in reqs]
    tasks = [asyncio.ensure_future(_send(target, r, o)) for r, o in zip(reqs, outs, strict=True)]
    try:
        await _until_chunks(outs, MIXED_LEAD, tasks)
        s0 = await _scrape(target)
        await _until_chunks(outs, MIXED_LEAD + MIN_WINDOW_STEPS, tasks)
        s1 = await _scrape(target)
        if any(t.done() for t in tasks):
            raise PhaseUnusable(f"{where}: a decode request ended before the prompt was sent")
        prompt = unique_prompts(rng, 1, phase.new, vocab)[0].tolist()
        injected = await _send(target, LoadRequest(rid("mixed-prefill"), prompt, 1))
        s2 = await _scrape(target)
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        task.result()  # a failed decode request fails the calibration, as elsewhere
    assert injected.sent is not None
    first = injected.sent + float(injected.chunk_times[0])
    gaps, context = [], 0.0
    for req, out in zip(reqs, outs, strict=True):
        t, k = _token_series(out, where)
        if t[-1] <= first:
            raise PhaseUnusable(f"{where}: a decode request ended before the prompt's step")
        i = int(np.argmin(np.abs(t - first)))
        if i >= 1 and k[i] - k[i - 1] == 1:  # one token: the chunk is that step's alone
            gaps.append(float(t[i] - t[i - 1]))
        # a row attends its computed tokens and the one it runs in that step
        context += len(req.prompt) + float(k[i - 1] if i >= 1 else 0.0)
    if not gaps and engine_clock is None:
        raise PhaseUnusable(f"{where}: no decode row streamed that step's token on its own")
    client = float(np.median(gaps)) if gaps else float("nan")
    m = MixedMeasurement(rows=phase.rows, new=phase.new, context_tokens=context, client_s=client)
    if engine_clock == "agentab":
        _engine_mixed(m, s0, s1, s2, where)
    return m


def _engine_mixed(m: MixedMeasurement, s0: Sample, s1: Sample, s2: Sample, where: str) -> None:
    """The mixed step's seconds from agentab's standard-path counters (see _mixed_phase)."""
    seconds, steps = STEP_SECONDS.format(path="standard"), STEPS.format(path="standard")
    decode = DECODE_STEPS.format(path="standard")

    def delta(a: Sample, b: Sample, name: str) -> float:
        return b[1].get(name, 0.0) - a[1].get(name, 0.0)

    window = delta(s0, s1, decode)
    if window < MIN_WINDOW_STEPS // 2 or delta(s0, s1, steps) != window:
        raise PhaseUnusable(
            f"{where}: the standard path ran {int(delta(s0, s1, steps))} steps "
            f"({int(window)} decode-only) in the decode window before the prompt"
        )
    m.decode_step_s = delta(s0, s1, seconds) / window
    others = delta(s1, s2, steps) - delta(s1, s2, decode)
    if others != 1:
        raise PhaseUnusable(f"{where}: {int(others)} steps with a prompt, not 1, around it")
    m.engine_s = delta(s1, s2, seconds) - delta(s1, s2, decode) * m.decode_step_s
    if m.engine_s <= 0:
        # The decode steps around the prompt ran slower than the window's (a busy host): what
        # is left for the prompt's step is noise, not its time.
        raise PhaseUnusable(
            f"{where}: the prompt's step came out {m.engine_s * 1e3:.3f} ms (the decode steps "
            f"around it ran slower than the {m.decode_step_s * 1e3:.3f} ms of the window before)"
        )
