"""Least-squares fits of the simulator's step-time model (docs/engine.md, "Step-time model").

What a timed load identifies, and what it cannot:
- decode: a pure decode step of T padded tokens with C context tokens costs
  `step_fixed_us + num_layers * layer_time_us(T) + C * kv_read_us`. Timing steps identifies
  the sum `base(T) = step_fixed_us + num_layers * layer_time_us(T)` at each calibrated T and
  the slope `kv_read_us`, never how `base` splits into a fixed part and layers. A calibrated
  profile therefore states whole-step times (`num_layers = 1`, `step_fixed_us = 0`), which
  the simulator prices identically.
- prefill: a step of `n` new tokens after `c` cached ones costs `base(min(n, T_max))` (the
  mixed-step rule) `+ n * us_per_token + pairs * us_per_pair + c * us_per_context_token`,
  pairs = n*c + n(n+1)/2. The last term is work per computed context token whatever the
  chunk's length: MLA prefill expands every cached latent into per-head keys and values
  before attending (vLLM's chunked-context path does the same), so a short turn after a long
  cached prefix, the agentic pattern, costs far more than its pairs say. Prompts of several
  lengths with and without a cached prefix separate the three rates. The table's
  value at prefill sizes (beyond the largest decode batch timed) is fitted too, as one more
  table point at the shortest prefill: the step's cost outside the two rates (it may lie below
  the largest decode batch's: a single prompt can cost less than many decode rows, which the
  mixed-step rule, pricing a step by its token count alone, cannot say). Client-side, it
  also holds the request's own latency outside the engine (HTTP, the frontend, streaming the
  first token back), which the simulator then charges to the prefill step.
  The prefill points are fitted for relative error, each weighted by 1 / its measured time: a
  timed request's noise grows with its length (a pause, a busier core), and unweighted, a few
  percent of the longest prompt's time outweighs the whole of the shortest one's, which is the
  point that pins the table's value; that value then swings with the noise, below zero at times.
- mixed: a step that computes a prompt of `new` tokens beside `rows` decode rows costs what
  the terms above price for it (the table at T = new + rows, the rows' KV read, the prompt's
  rates) plus `rows * mixed_decode_row_us`: an engine that attends a mixed step's decode rows
  one by one pays per row what a decode step pays per batch. The measured step less the priced
  terms, over several `rows`, is fitted as `offset + rows * per_row`; only the slope goes into
  the profile, the offset (what the priced terms miss for this prompt, and client-side the
  request latency that the table's last point holds and a step between two chunks does not) is
  reported beside the residuals, which are those of the profile's price (without the offset).
- mixed verify (a server that drafts, k drafts a row): its mixed phases run the prompt beside
  `rows` verify rows of 1 + k tokens. The step less what the profile prices for it (the table
  at T = new + rows * (1 + k), the KV read of each row's context and drafts, the prompt's
  rates, the drafter, `mixed_decode_row_us` and `verify_context_token_us` per row) is fitted
  as `offset + rows * per_row` as above; the slope is `mixed_verify_row_us`, what a verify row
  costs beside a prompt's chunk beyond what the pure verify steps and a mixed step's one-token
  rows price (a mixed step runs outside the decode graphs that time the verify steps).
- frontend: with the engine's clock the steps are timed without anything outside them, so
  each prefill request's client TTFT less its step time is what the request cost outside the
  engine. Where the server splits its own part (agentab's per-request histograms: intake,
  queue, prefill, output), the rest is the network both ways, counted half on each way:
  intake = half the rest + the server's intake + its queue (at idle the simulator's is 0);
  output = the server's prefill less the step time (host work around the step) + its output +
  half the rest. Without the split, the whole difference is charged to intake. Medians over
  the prefill requests (one request at a time on an idle engine). With the client's clock the
  prefill table already holds this latency (see prefill above), so nothing is fitted.
- verify (a server that drafts, k drafts a row): each of its decode phases is a run of verify
  steps of `batch` rows x (1 + k) tokens; the step less what the standard path's table (at the
  padded token count), the KV read and the fitted drafter price is fitted through the origin
  over `k * context tokens`: `verify_context_token_us`, what an attention that reads a verify
  row's KV once per query token (not once per row) pays beyond a decode row's read. Two
  contexts per batch separate it from the table, which the short context pins.
Rates are constrained to be >= 0 (a coefficient fitted negative is noise around zero: it is
set to zero and the rest refitted). numpy's `lstsq` is enough for these few unknowns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agentab.calibrate.client import (
    DecodeMeasurement,
    Measurements,
    MixedMeasurement,
    PrefillMeasurement,
)
from agentab.engine.paths import graph_padding, padded_tokens
from agentab.errors import AgentabError

# The measurements of the server that drafts (speculative decoding), beside the decode paths'.
DRAFTER = "drafter"


@dataclass
class Coefficient:
    value: float
    stderr: float | None  # None when the fit had no residual degrees of freedom


@dataclass
class DecodeFit:
    path: str
    batch_tokens: list[int]
    step_us: list[float]  # base(T): whole-step time at each padded batch, context excluded
    step_stderr_us: list[float | None]
    kv_us_per_token: Coefficient | None  # None: the load did not vary the context
    residuals: list[dict[str, float]]  # per phase: batch, context, measured, fitted, error

    @property
    def kv_us(self) -> float:
        """The KV read per context token per step (0 where the load could not identify it)."""
        return self.kv_us_per_token.value if self.kv_us_per_token is not None else 0.0


@dataclass
class PrefillFit:
    us_per_token: Coefficient
    us_per_pair: Coefficient
    # per token of a prefill row's computed context (cached prefix, earlier chunks) per step;
    # None when the load had no prefill after a cached prefix
    us_per_context_token: Coefficient | None
    tail_tokens: int  # the shortest prefill: the standard table's point for prefill steps
    tail_us: Coefficient  # the table's value there (a step's cost outside the prefill rates)
    residuals: list[dict[str, float]]


@dataclass
class MixedFit:
    us_per_decode_row: Coefficient  # per decode row of a step with prefill tokens
    offset_us: Coefficient  # per step, not written to the profile (see the module docstring)
    residuals: list[dict[str, float]]


@dataclass
class FrontendFit:
    intake_us: float  # median over the prefill requests: client send to the engine's step
    output_us: float  # median: the step's end (as the engine times it) to the client's chunk
    split: str  # "server" (the server's own stamps split it) or "client" (all to intake)
    requests: list[dict[str, float]]  # per request: new, cached, ttft, step, intake, output (us)


@dataclass
class DrafterFit:
    step_us: Coefficient  # per step that drafts, whatever its rows
    row_us: Coefficient  # per row drafted for
    residuals: list[dict[str, float]]  # per phase: batch, context, measured, fitted, error
    # per context token per draft token of a verify row; None: no step timings, k unknown or
    # one context only (the verify steps' price then has no such term)
    verify_context_us: Coefficient | None = None
    verify_residuals: list[dict[str, float]] = field(default_factory=list)  # whole verify steps
    # per verify row of a step with prefill tokens (`mixed_verify_row_us`); None: the server
    # that drafts ran no mixed phase (or k unknown, or client timing)
    mixed_verify: MixedFit | None = None


@dataclass
class Fit:
    timing: str  # client | engine
    decode: dict[str, DecodeFit] = field(default_factory=dict)
    prefill: PrefillFit | None = None
    mixed: MixedFit | None = None  # None: the load ran no mixed step
    frontend: FrontendFit | None = None  # None: client timing (the prefill table holds it)
    drafter: DrafterFit | None = None  # None: no server that drafts was timed


def _lstsq(x: np.ndarray, y: np.ndarray, nonneg: list[int]) -> tuple[np.ndarray, np.ndarray | None]:
    """Least squares with the columns in `nonneg` kept >= 0 (drop the most negative, refit)."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        coef[active] = sol
        bad = [j for j in nonneg if j in active and coef[j] < 0]
        if not bad:
            break
        active.remove(min(bad, key=lambda j: coef[j]))
    dof = len(y) - len(active)
    stderr = None
    if dof > 0:
        resid = y - x @ coef
        sigma2 = float(resid @ resid) / dof
        cov = sigma2 * np.linalg.pinv(x[:, active].T @ x[:, active])
        stderr = np.zeros(x.shape[1])
        stderr[active] = np.sqrt(np.maximum(np.diag(cov), 0.0))
    return coef, stderr


def _coef(coef: np.ndarray, stderr: np.ndarray | None, j: int) -> Coefficient:
    return Coefficient(float(coef[j]), None if stderr is None else float(stderr[j]))


def fit_decode(
    rows: list[DecodeMeasurement], *, path: str, timing: str, graph_max: int
) -> DecodeFit:
    """base(T) per calibrated padded batch and one KV slope shared by all batches."""
    if not rows:
        raise AgentabError(f"decode path {path}: no calibration phase ran on it")
    y = np.array([_decode_time(r, timing) for r in rows]) * 1e6
    tokens = [padded_tokens(r.batch, graph_max) for r in rows]
    table = sorted(set(tokens))
    x = np.zeros((len(rows), len(table) + 1))
    for i, (t, r) in enumerate(zip(tokens, rows, strict=True)):
        x[i, table.index(t)] = 1.0
        x[i, -1] = r.context_tokens
    varied = any(
        len({r.context for r, t in zip(rows, tokens, strict=True) if t == key}) > 1 for key in table
    )
    if not varied:
        x = x[:, :-1]
    coef, stderr = _lstsq(x, y, nonneg=[len(table)] if varied else [])
    fitted = x @ coef
    residuals = [
        {
            "batch": r.batch,
            "context": r.context,
            "context_tokens": round(r.context_tokens, 1),
            "measured_us": round(float(m), 2),
            "fitted_us": round(float(f), 2),
            "error": round(float(f / m - 1), 5),
        }
        for r, m, f in zip(rows, y, fitted, strict=True)
    ]
    return DecodeFit(
        path=path,
        batch_tokens=table,
        step_us=[float(v) for v in coef[: len(table)]],
        step_stderr_us=(
            [None] * len(table) if stderr is None else [float(s) for s in stderr[: len(table)]]
        ),
        kv_us_per_token=_coef(coef, stderr, len(table)) if varied else None,
        residuals=residuals,
    )


def _decode_time(r: DecodeMeasurement, timing: str) -> float:
    if timing == "engine":
        assert r.engine_step_s is not None
        return r.engine_step_s
    return r.client_step_s


def fit_prefill(
    rows: list[PrefillMeasurement],
    standard: DecodeFit,
    *,
    timing: str,
    max_num_batched_tokens: int,
    graph_tokens: tuple[int, ...] = (),
) -> PrefillFit:
    """Per-token and per-pair prefill rates and the standard table's value at prefill sizes.
    `graph_tokens`: the engine's prefill graph sizes; a step's padding up to the next one
    counts as prompt tokens (the graphed layers compute the padded rows)."""
    if not rows:
        raise AgentabError("prefill: no calibration request ran")
    points = _median_points(rows, timing)
    tail_t = min(min(new, max_num_batched_tokens) for new, _ in points)
    table_t = np.array(standard.batch_tokens, dtype=np.float64)
    table_us = np.array(standard.step_us)
    if tail_t <= table_t[-1]:
        raise AgentabError(
            f"prefill: the shortest prefill ({tail_t} tokens) must be longer than the largest "
            f"decode batch ({int(table_t[-1])})"
        )
    y, x = [], []
    for (new, cached), measured_us in points.items():
        known, tail_w, tokens, pairs, context = 0.0, 0.0, 0.0, 0.0, 0.0
        done, left = cached, new
        while left > 0:  # chunked prefill: one step per budget's worth of tokens
            n = min(left, max_num_batched_tokens)
            # the step's table part at T = n: the decode table up to its last timed batch, then
            # linear up to the tail point at tail_t, flat beyond (the simulator's interpolation)
            w = float(np.clip((n - table_t[-1]) / (tail_t - table_t[-1]), 0.0, 1.0))
            if n <= table_t[-1]:
                known += float(np.interp(n, table_t, table_us))
            else:
                known += (1 - w) * float(table_us[-1])
                tail_w += w
            tokens += n + graph_padding(n, graph_tokens)
            pairs += n * done + n * (n + 1) / 2
            context += done
            done += n
            left -= n
        y.append(measured_us - known)
        x.append([tokens, pairs, tail_w, context])
    xa, ya = np.array(x), np.array(y)
    if len({r[0] for r in x}) < 3 or len({r[1] for r in x}) < 3:
        raise AgentabError("prefill: the load must vary the prompt length to fit the rates")
    with_context = len({r[3] for r in x}) > 1
    if not with_context:
        xa = xa[:, :3]
    # relative errors (module docstring): weight each point by 1 / its measured time
    weight = 1.0 / np.array(list(points.values()))
    coef, stderr = _lstsq(xa * weight[:, None], ya * weight, nonneg=list(range(xa.shape[1])))
    fitted = xa @ coef
    residuals = [
        {
            "new": new,
            "cached": cached,
            "measured_us": round(float(m), 2),
            "fitted_us": round(float(f + (m - yy)), 2),
            "error": round(float((f + (m - yy)) / m - 1), 5),
        }
        for ((new, cached), m), yy, f in zip(points.items(), ya, fitted, strict=True)
    ]
    return PrefillFit(
        us_per_token=_coef(coef, stderr, 0),
        us_per_pair=_coef(coef, stderr, 1),
        us_per_context_token=_coef(coef, stderr, 3) if with_context else None,
        tail_tokens=int(tail_t),
        tail_us=_coef(coef, stderr, 2),
        residuals=residuals,
    )


def _median_points(rows: list[PrefillMeasurement], timing: str) -> dict[tuple[int, int], float]:
    """Median time per (new, cached) point over its repetitions (robust to a stray pause)."""
    by: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        t = r.engine_s if timing == "engine" else r.ttft_s
        if t is None:
            raise AgentabError("prefill: the engine exported no step counters for --timing engine")
        by.setdefault((r.new, r.cached), []).append(t * 1e6)
    return {k: float(np.median(v)) for k, v in sorted(by.items())}


def fit_mixed(
    rows: list[MixedMeasurement],
    standard: DecodeFit,
    prefill: PrefillFit,
    *,
    timing: str,
    graph_tokens: tuple[int, ...] = (),
) -> MixedFit | None:
    """The cost per decode row of a mixed step (module docstring); None without mixed steps."""
    if not rows:
        return None
    return _fit_per_row(
        rows, standard, prefill, timing=timing, what="decode", graph_tokens=graph_tokens
    )


def _fit_per_row(
    rows: list[MixedMeasurement],
    standard: DecodeFit,
    prefill: PrefillFit,
    *,
    timing: str,
    what: str,
    draft_tokens: int = 0,
    step_us: float = 0.0,
    row_us: float = 0.0,
    verify_context_us: float = 0.0,
    graph_tokens: tuple[int, ...] = (),
) -> MixedFit:
    """The measured mixed steps less what the profile already prices for them, fitted as
    `offset + rows * per_row`. With `draft_tokens` k the rows are verify rows of 1 + k tokens
    (each attends its context and its k drafts), and the profile also prices `step_us` per
    step and `row_us` per row (the drafter, `mixed_decode_row_us`) and `verify_context_us`
    per context token per draft token; `graph_tokens`: the step's padding up to the engine's
    next prefill graph size is priced as prompt tokens."""
    by: dict[tuple[int, int], list[MixedMeasurement]] = {}
    for r in rows:
        by.setdefault((r.rows, r.new), []).append(r)
    if len({n for n, _ in by}) < 2:
        raise AgentabError(f"mixed: the load must vary the {what} rows beside the prompt")
    table_t = np.array([*standard.batch_tokens, prefill.tail_tokens], dtype=np.float64)
    table_us = np.array([*standard.step_us, prefill.tail_us.value])
    kv = standard.kv_us
    q = 1 + draft_tokens
    points, priced, x = [], [], []
    for (n, new), group in sorted(by.items()):
        times = [_mixed_time(r, timing) for r in group]
        measured_us = float(np.median(times)) * 1e6
        # a row attends its computed tokens and the 1 + k it runs in that step
        context = float(np.mean([r.context_tokens for r in group])) + n * draft_tokens
        us = float(np.interp(n * q + new, table_t, table_us)) + kv * context
        padded = new + graph_padding(n * q + new, graph_tokens)
        us += prefill.us_per_token.value * padded + prefill.us_per_pair.value * new * (new + 1) / 2
        us += step_us + row_us * n + verify_context_us * draft_tokens * context
        points.append((n, new, context, measured_us))
        priced.append(us)
        x.append([float(n), 1.0])
    xa = np.array(x)
    ya = np.array([p[3] for p in points]) - np.array(priced)
    coef, stderr = _lstsq(xa, ya, nonneg=[0])
    per_row = _coef(coef, stderr, 0)
    residuals = []
    for (n, new, context, m), us in zip(points, priced, strict=True):
        f = us + per_row.value * n
        residuals.append(
            {
                "rows": n,
                "new": new,
                "context_tokens": round(context, 1),
                "measured_us": round(m, 2),
                "fitted_us": round(f, 2),
                "error": round(f / m - 1, 5),
            }
        )
    return MixedFit(
        us_per_decode_row=per_row, offset_us=_coef(coef, stderr, 1), residuals=residuals
    )


def fit_mixed_verify(
    rows: list[MixedMeasurement], fit: Fit, draft_tokens: int, graph_tokens: tuple[int, ...] = ()
) -> MixedFit | None:
    """The cost per verify row of a mixed step (module docstring), from the mixed phases of
    the server that drafts; None without them. Needs the standard path, prefill, mixed and
    drafter fits, which price the rest of those steps."""
    if not rows:
        return None
    assert fit.prefill is not None and fit.drafter is not None
    d = fit.drafter
    mixed_row = fit.mixed.us_per_decode_row.value if fit.mixed is not None else 0.0
    verify = d.verify_context_us.value if d.verify_context_us is not None else 0.0
    return _fit_per_row(
        rows, fit.decode["standard"], fit.prefill, timing="engine", what="verify",
        draft_tokens=draft_tokens, step_us=d.step_us.value, row_us=d.row_us.value + mixed_row,
        verify_context_us=verify, graph_tokens=graph_tokens,
    )  # fmt: skip


def _mixed_time(r: MixedMeasurement, timing: str) -> float:
    if timing == "engine":
        if r.engine_s is None:
            raise AgentabError("mixed: the engine exported no step timing for --timing engine")
        return r.engine_s
    return r.client_s


def fit_all(
    measured: dict[str, Measurements],
    *,
    timing: str,
    graph_max: int,
    max_num_batched_tokens: int,
    draft_tokens: int = 0,
    graph_tokens: tuple[int, ...] = (),
) -> Fit:
    """Fit each path from the server that ran it; prefill from the standard path's server.
    `draft_tokens`: k of the server that drafts (its verify steps' query length is 1 + k);
    `graph_tokens`: the engine's prefill graph sizes (steps with prefill are padded to them)."""
    fit = Fit(timing=timing)
    for path, m in measured.items():
        if path != DRAFTER:
            fit.decode[path] = fit_decode(m.decode, path=path, timing=timing, graph_max=graph_max)
    if DRAFTER in measured:
        fit.drafter = fit_drafter(measured[DRAFTER].decode)
        if timing == "engine" and draft_tokens > 0:
            fit_verify(
                fit.drafter, measured[DRAFTER].decode, fit.decode["standard"], draft_tokens,
                graph_max=graph_max,
            )  # fmt: skip
    fit.prefill = fit_prefill(
        measured["standard"].prefill,
        fit.decode["standard"],
        timing=timing,
        max_num_batched_tokens=max_num_batched_tokens,
        graph_tokens=graph_tokens,
    )
    fit.mixed = fit_mixed(
        measured["standard"].mixed,
        fit.decode["standard"],
        fit.prefill,
        timing=timing,
        graph_tokens=graph_tokens,
    )
    if fit.drafter is not None and timing == "engine" and draft_tokens > 0:
        fit.drafter.mixed_verify = fit_mixed_verify(
            measured[DRAFTER].mixed, fit, draft_tokens, graph_tokens
        )
    if timing == "engine":
        fit.frontend = fit_frontend(measured["standard"].prefill)
    return fit


def fit_drafter(rows: list[DecodeMeasurement]) -> DrafterFit:
    """The drafter's time per step that drafts, `step_us + rows * row_us`, from the decode
    phases of a server that drafts (the engine's own drafter timings). A drafter that runs
    decoder layers k times (early exit, EAGLE, MTP) costs a fixed part (launches, its LM
    head's weights) and a part that grows with the rows."""
    timed = [r for r in rows if r.engine_draft_s is not None]
    if len({r.batch for r in timed}) < 2:
        raise AgentabError(
            "the drafter phase: its server reported drafter timings at fewer than two batch "
            "sizes (agentab:draft_steps_total); time it at two or more --batches"
        )
    x = np.array([[1.0, r.batch] for r in timed])
    y = np.array([r.engine_draft_s or 0.0 for r in timed]) * 1e6
    coef, stderr = _lstsq(x, y, nonneg=[0, 1])
    fitted = x @ coef
    residuals = [
        {"batch": r.batch, "context": r.context, "measured_us": float(m), "fitted_us": float(f),
         "error": float((f - m) / m)}
        for r, m, f in zip(timed, y, fitted, strict=True)
    ]  # fmt: skip
    return DrafterFit(_coef(coef, stderr, 0), _coef(coef, stderr, 1), residuals)


def fit_verify(
    drafter: DrafterFit,
    rows: list[DecodeMeasurement],
    standard: DecodeFit,
    draft_tokens: int,
    *,
    graph_max: int,
) -> None:
    """`verify_context_token_us` (module docstring) from the drafter phases' whole-step
    timings, into `drafter`; left None when the phases do not vary the context."""
    timed = [r for r in rows if r.engine_step_s is not None]
    if len({r.context for r in timed}) < 2:
        return
    kv = standard.kv_us
    table_t = np.array(standard.batch_tokens, dtype=np.float64)
    table_us = np.array(standard.step_us)
    priced, x, y = [], [], []
    for r in timed:
        tokens = padded_tokens(r.batch * (1 + draft_tokens), graph_max)
        us = float(np.interp(tokens, table_t, table_us)) + kv * r.context_tokens
        us += drafter.step_us.value + drafter.row_us.value * r.batch
        priced.append(us)
        x.append([draft_tokens * r.context_tokens])
        y.append((r.engine_step_s or 0.0) * 1e6)
    xa, ya = np.array(x), np.array(y)
    coef, stderr = _lstsq(xa, ya - np.array(priced), nonneg=[0])
    drafter.verify_context_us = _coef(coef, stderr, 0)
    drafter.verify_residuals = [
        {"batch": r.batch, "context": r.context, "context_tokens": round(r.context_tokens, 1),
         "measured_us": round(float(m), 2), "fitted_us": round(float(f), 2),
         "error": round(float((f - m) / m), 5)}
        for r, m, f in zip(timed, ya, np.array(priced) + xa[:, 0] * coef[0], strict=True)
    ]  # fmt: skip


def fit_frontend(prefill: list[PrefillMeasurement]) -> FrontendFit | None:
    """What each prefill request cost outside the engine's steps (see the module docstring)."""
    rows = []
    split = "server"
    for m in prefill:
        if m.engine_s is None:
            continue
        s = m.server_s
        if s is None:
            split = "client"
            intake, output = m.ttft_s - m.engine_s, 0.0
        else:
            rest = m.ttft_s - (s["intake"] + s["queue"] + s["prefill"] + s["output"])
            intake = rest / 2 + s["intake"] + s["queue"]
            output = (s["prefill"] - m.engine_s) + s["output"] + rest / 2
        rows.append(
            {
                "new": m.new,
                "cached": m.cached,
                "ttft_us": m.ttft_s * 1e6,
                "step_us": m.engine_s * 1e6,
                "intake_us": intake * 1e6,
                "output_us": output * 1e6,
            }
        )
    if not rows:
        return None
    if split == "client":  # some requests had no split: charge every one the same way
        for r in rows:
            r["intake_us"], r["output_us"] = r["ttft_us"] - r["step_us"], 0.0
    return FrontendFit(
        intake_us=max(float(np.median([r["intake_us"] for r in rows])), 0.0),
        output_us=max(float(np.median([r["output_us"] for r in rows])), 0.0),
        split=split,
        requests=rows,
    )
