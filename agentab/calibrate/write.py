"""Write a calibrated HardwareProfile (TOML, one comment per key) and its fit report (JSON).

Every value is tagged with where it comes from:
  [C] calibrated: fitted from the timed load (the report beside the profile has its residuals);
  [E] stated by the engine (`facts.py` says through which endpoint); [U] stated by the user;
  [F] a factorization convention: the load identifies only a product (whole-step time, KV
      microseconds per context token, prefill microseconds per token and per pair), the
      factors are written so the simulator prices exactly that product;
  [R] the decode path's rule (docs/engine.md, "Decode paths"), not a cost;
  [A] assumed: the load could not identify it and `--allow-assumed` named it.
A field the load could not identify is refused unless `--allow-assumed FIELD` names it, so a
profile never carries a guess that nobody chose.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from agentab.calibrate.facts import EngineFacts
from agentab.calibrate.fit import Coefficient, DecodeFit, DrafterFit, Fit
from agentab.engine.profile import parse_profile
from agentab.errors import AgentabError
from agentab.redact import redact_text

# The latency_specialized path's limits (docs/engine.md, "Decode paths"): rules, not costs.
SPECIALIZED_MAX_PADDED = 64
SPECIALIZED_MAX_REQUESTS_BY_Q = (64, 32, 19, 16, 12, 10, 8, 8)
# Fields a calibration may leave unidentified, with the value written when they are assumed.
ASSUMABLE = {
    "decode.specialized": "the standard path's table (no latency_specialized server was timed)",
    "spec_decode.drafter_step_us": "0 (the load runs no drafter)",
    "kv_cache.hbm_read_bytes_per_s": "no KV read cost (the load did not vary the context)",
    "kv_cache.capacity_blocks": "1,000,000 blocks (no capacity stated or observed)",
    "kv_cache.block_size_tokens": "16 tokens (vLLM's default)",
    "decode.cuda_graph_max_tokens": "1 (no CUDA-graph padding)",
    "gpu_count": "1 GPU (also tp = 1)",
    "prefill.context_token_us": "0 (the load ran no prefill after a cached prefix)",
    "prefill.mixed_decode_row_us": "0 (the load ran no mixed step)",
    "engine.async_scheduling": "false (the engine did not say whether it schedules ahead)",
}


@dataclass
class Provenance:
    engine: str
    version: str | None
    device: str | None
    model: str | None
    url: str
    date: str
    command: str
    timing: str
    urls: dict[str, str] = field(default_factory=dict)  # decode path -> server timed for it
    engine_source: str | None = None  # agentab's engines: the digest of the engine code timed


def _num(v: float) -> str:
    return repr(float(f"{v:.6g}"))


def _pm(c: Coefficient | None, scale: float = 1.0, unit: str = "") -> str:
    if c is None:
        return "not fitted"
    err = "" if c.stderr is None else f" +- {c.stderr * scale:.3g}"
    return f"{c.value * scale:.4g}{err}{unit}"


def unidentified_fields(fit: Fit, facts: EngineFacts, kv_blocks: int | None) -> list[str]:
    missing = []
    if "specialized" not in fit.decode:
        missing.append("decode.specialized")
    if fit.drafter is None:
        missing.append("spec_decode.drafter_step_us")
    if fit.decode["standard"].kv_us_per_token is None:
        missing.append("kv_cache.hbm_read_bytes_per_s")
    if kv_blocks is None:
        missing.append("kv_cache.capacity_blocks")
    if facts.block_size is None:
        missing.append("kv_cache.block_size_tokens")
    if facts.cuda_graph_max_tokens is None:
        missing.append("decode.cuda_graph_max_tokens")
    if facts.gpu_count is None:
        missing.append("gpu_count")
    if fit.prefill is not None and fit.prefill.us_per_context_token is None:
        missing.append("prefill.context_token_us")
    if fit.mixed is None:
        missing.append("prefill.mixed_decode_row_us")
    if facts.async_scheduling is None:
        missing.append("engine.async_scheduling")
    return missing


def check_assumed(missing: list[str], allowed: tuple[str, ...]) -> None:
    """Refuse a guess nobody chose; refuse an --allow-assumed that names nothing missing."""
    unknown = sorted(set(allowed) - set(ASSUMABLE))
    if unknown:
        raise AgentabError(
            f"--allow-assumed {unknown[0]}: not a field calibration can leave unidentified "
            f"(those are: {', '.join(ASSUMABLE)})"
        )
    refused = [f for f in missing if f not in allowed]
    if refused:
        detail = "; ".join(f"{f} (would be {ASSUMABLE[f]})" for f in refused)
        flags = " ".join(f"--allow-assumed {f}" for f in refused)
        raise AgentabError(
            f"the calibration load could not identify: {detail}; refusing to write a profile "
            f"with a guess: measure them (see --help) or accept the assumption with {flags}"
        )


def _table(
    lines: list[str], header: str, d: DecodeFit, tag: str, tail: tuple[int, Coefficient] | None
) -> None:
    """A decode table; the standard one ends with the point prefill steps are priced at."""
    tokens, values = list(d.batch_tokens), list(d.step_us)
    errs = ["-" if s is None else f"{s:.3g}" for s in d.step_stderr_us]
    if tail is not None:
        tokens.append(tail[0])
        values.append(tail[1].value)
        errs.append("-" if tail[1].stderr is None else f"{tail[1].stderr:.3g}")
    lines.append("")
    lines.append(f"[{header}]")
    note = f"; the last, {tail[0]}, from the prefill load" if tail else ""
    lines.append(f"batch_tokens = {tokens}  # {tag} padded batch tokens timed{note}")
    lines.append(
        f"layer_time_us = [{', '.join(_num(v) for v in values)}]  # {tag} whole-step times "
        f"(stderr us: {', '.join(errs)})"
    )
    lines.append("step_fixed_us = 0.0  # [F] included in layer_time_us (num_layers = 1)")


def _drafter_lines(fit: Fit) -> list[str]:
    """The drafter's cost: fitted where a server that drafts was timed, else assumed 0."""
    d = fit.drafter
    if d is None:
        return ["drafter_step_us = 0.0  # [A] the calibration load runs no drafter"]
    where = "from the drafter phase (agentab:draft_device_seconds_total / draft_steps_total)"
    return [
        f"drafter_step_us = {_num(d.step_us.value)}  # [C] {_pm(d.step_us, unit=' us')} per "
        f"step that drafts, {where}",
        f"drafter_row_us = {_num(d.row_us.value)}  # [C] {_pm(d.row_us, unit=' us')} per row "
        "drafted for",
        *_verify_lines(d),
        *_mixed_verify_lines(d),
    ]


def _mixed_verify_lines(d: DrafterFit) -> list[str]:
    """The verify rows' cost in a step with prefill, where the server that drafts ran mixed
    phases (else the key is left out: such a row is priced as any decode row of a mixed step)."""
    m = d.mixed_verify
    if m is None:
        return []
    return [
        f"mixed_verify_row_us = {_num(m.us_per_decode_row.value)}  # [C] "
        f"{_pm(m.us_per_decode_row, unit=' us')} per verify row of a step with prefill, from "
        "the drafter's mixed phases less what the rest of the profile prices"
    ]


def _verify_lines(d: DrafterFit) -> list[str]:
    """The verify rows' extra KV read, where the drafter phases timed whole steps at two
    contexts or more (else the profile has no such term: 0)."""
    v = d.verify_context_us
    if v is None:
        return []
    return [
        f"verify_context_token_us = {_num(v.value)}  # [C] {_pm(v, unit=' us')} per context "
        "token per draft token of a verify row, from the drafter phases' step times less the "
        "standard table, KV read and drafter"
    ]


def render_profile(
    *,
    name: str,
    fit: Fit,
    facts: EngineFacts,
    provenance: Provenance,
    kv_blocks: int | None,
    kv_blocks_tag: str,
    gpu_count: int | None,
    gpu_tag: str,
    tp: int | None,
    allowed: tuple[str, ...],
) -> str:
    missing = unidentified_fields(fit, facts, kv_blocks)
    check_assumed(missing, allowed)
    std = fit.decode["standard"]
    spec = fit.decode.get("specialized")
    pre = fit.prefill
    assert pre is not None
    gpus = gpu_count or 1
    kv = std.kv_us_per_token
    lines = [
        f"# CALIBRATED profile, written by `agentab calibrate` ({provenance.date}):",
        f"#   {provenance.command}",
        f"# Engine: {provenance.engine} {provenance.version or '(version not reported)'}, "
        f"model {provenance.model}, device {provenance.device or 'not reported'}, "
        f"timed at {provenance.url}",
        *(
            [f"# Engine source: {provenance.engine_source} (the digest of agentab's engine code)"]
            if provenance.engine_source
            else []
        ),
        f"# Timing: {provenance.timing} "
        + (
            "(the engine's own step counters)"
            if provenance.timing == "engine"
            else "(client-side chunk arrival times)"
        )
        + ". Fit residuals: the .fit.json file beside this one.",
        "# Tags: [C] calibrated (fitted), [E] stated by the engine, [U] stated by the user,",
        "#   [F] factorization convention (the load identifies only the product; the simulator",
        "#   prices the product exactly), [R] decode-path rule, [A] assumed (--allow-assumed).",
    ]
    if missing:
        lines.append(f"# Assumed (named by --allow-assumed): {', '.join(missing)}.")
    a = "[A]"
    lines += [
        "format_version = 1  # profile file format (docs/engine.md)",
        f"name = {json.dumps(name)}  # identity, recorded in run manifests with the file hash",
        'status = "measured"  # calibrated from timed load; [A] fields are not measured',
        f"model = {json.dumps(facts.model or 'unknown')}  # [E]",
        f"gpu_name = {json.dumps(facts.device or 'unknown')}  # [E] device",
        f"gpu_count = {gpus}  # {gpu_tag if gpu_count else a}",
        f"tp = {tp or 1}  # {gpu_tag if tp else a}",
        "num_layers = 1  # [F] the decode tables hold whole-step times",
        "kv_layers = 1  # [F] the KV term is stated per step, all layers together",
        "",
        "[kv_cache]",
    ]
    bs_tag = "[E]" if facts.block_size else a
    lines.append(f"block_size_tokens = {facts.block_size or 16}  # {bs_tag}")
    lines.append(
        f"capacity_blocks = {kv_blocks or 1_000_000}  # {kv_blocks_tag if kv_blocks else a}"
    )
    if kv is None or kv.value <= 0:
        why = "fitted 0" if kv is not None else "not identified"
        lines.append(f"bytes_per_token_per_layer = 0.0  # [F] no KV read cost ({why})")
        lines.append(f"hbm_read_bytes_per_s = 1.0  # {'[C]' if kv is not None else a} unused")
    else:
        lines.append(
            "bytes_per_token_per_layer = 1.0  # [F] with the bandwidth below: us per context token"
        )
        lines.append(
            f"hbm_read_bytes_per_s = {_num(1e6 / kv.value)}  # [C] 1e6 / KV read "
            f"{_pm(kv, 1.0, ' us')} per context token per step"
        )
    graph = facts.cuda_graph_max_tokens
    lines += [
        "",
        "[decode]",
        f"cuda_graph_max_tokens = {graph or 1}  # {'[E]' if graph else a}"
        + (" no CUDA-graph padding" if (graph or 1) == 1 else " CUDA-graph capture limit"),
    ]
    _table(lines, "decode.standard", std, "[C]", (pre.tail_tokens, pre.tail_us))
    _table(
        lines, "decode.specialized", spec or std, "[C]" if spec else "[A] standard path's:", None
    )
    lines += [
        f"max_padded_tokens = {SPECIALIZED_MAX_PADDED}  # [R]",
        f"max_requests_by_q = {list(SPECIALIZED_MAX_REQUESTS_BY_Q)}  # [R] for q = 1..8",
        "",
        "[spec_decode]",
        *_drafter_lines(fit),
        "",
        "[prefill]",
    ]
    p, q = pre.us_per_token, pre.us_per_pair
    if p.value > 0:
        lines.append(
            f"tokens_per_s_per_gpu = {_num(1e6 / p.value / gpus)}  # [C] "
            f"{_pm(p, 1.0, ' us')} per prefill token"
        )
    else:
        lines.append("tokens_per_s_per_gpu = 1e+15  # [C] per-token cost fitted 0")
    if q.value > 0:
        lines.append("attention_flops_per_token_pair = 1.0  # [F] with the rate below: us per pair")
        lines.append(
            f"attention_flops_per_s_per_gpu = {_num(1e6 / q.value / gpus)}  # [C] "
            f"{_pm(q, 1e3, ' ns')} per query-key pair"
        )
    else:
        lines.append("attention_flops_per_token_pair = 0.0  # [C] per-pair cost fitted 0")
        lines.append("attention_flops_per_s_per_gpu = 1.0  # [F] unused")
    c = pre.us_per_context_token
    if c is None:
        lines.append("context_token_us = 0.0  # [A] the load ran no prefill after a cached prefix")
    else:
        lines.append(
            f"context_token_us = {_num(c.value)}  # [C] {_pm(c, 1e3, ' ns')} per computed "
            "context token of a prefill row, per step"
        )
    sizes = facts.prefill_graph_tokens
    if sizes:
        source = facts.sources.get("prefill_graph_tokens", "")
        tag = "[U]" if source.startswith("--") else "[E]"
        lines.append(
            f"graph_tokens = [{', '.join(map(str, sizes))}]  # {tag} {source}: steps with "
            "prefill are padded to the next"
        )
    mixed = fit.mixed
    if mixed is None:
        lines.append("mixed_decode_row_us = 0.0  # [A] the load ran no mixed step")
    else:
        lines.append(
            f"mixed_decode_row_us = {_num(mixed.us_per_decode_row.value)}  # [C] "
            f"{_pm(mixed.us_per_decode_row, 1.0, ' us')} per decode row of a step with prefill"
        )
    ahead = facts.async_scheduling
    source = facts.sources.get("async_scheduling", "")
    lines += [
        "",
        "[engine]",
        f"async_scheduling = {'true' if ahead else 'false'}  # "
        + (f"[E] {source}".rstrip() if ahead is not None else "[A] not stated by the engine"),
    ]
    _frontend(lines, fit)
    text = "\n".join(lines) + "\n"
    parse_profile(text.encode(), f"calibrated profile {name}")  # what we write must load
    return text


def _frontend(lines: list[str], fit: Fit) -> None:
    """`[frontend]`: the request's latency outside the steps (engine clock only)."""
    front = fit.frontend
    lines.append("")
    if front is None:
        lines.append(
            "# [frontend] not written: with the client's clock the prefill table's last point "
            "holds the request's latency outside the engine"
        )
        return
    n = len(front.requests)
    if front.split == "server":
        how = "the server's own stamps split it, the network counted half each way"
    else:
        how = "the server does not split it: all charged to intake"
    lines += [
        "[frontend]",
        f"intake_us = {_num(front.intake_us)}  # [C] client send to the engine's first step, "
        f"median of {n} prefill requests ({how})",
        f"output_us = {_num(front.output_us)}  # [C] the step's end (engine clock) to the "
        f"client's first chunk, median of {n}",
    ]


def write_outputs(path: Path, text: str, report: dict[str, Any]) -> tuple[Path, Path]:
    """The profile and its report (`NAME.fit.json`), each written whole or not at all."""
    report_path = write_report(path, report)
    _write_whole(path, text.encode())
    return path, report_path


def write_report(profile_path: Path, report: dict[str, Any]) -> Path:
    """The fit report beside the profile (`NAME.fit.json`); alone when no profile can be
    written, so `--refit` can fit its measurements again."""
    report_path = profile_path.with_suffix(".fit.json")
    _write_whole(report_path, orjson.dumps(report, option=orjson.OPT_INDENT_2, default=_default))
    return report_path


def _write_whole(target: Path, data: bytes) -> None:
    """Write `data` whole (a temporary name, then a rename), with the credentials of any URL in
    it (the servers timed, the command line) redacted."""
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(redact_text(data.decode()).encode())
    tmp.replace(target)


def fit_report(
    fit: Fit,
    facts: dict[str, EngineFacts],
    provenance: Provenance,
    load: dict[str, Any],
    assumed: list[str],
    scheduler: dict[str, Any],
) -> dict[str, Any]:
    return {
        "provenance": asdict(provenance),
        "engine": {path: f.to_dict() for path, f in facts.items()},
        "scheduler": scheduler,
        "load": load,
        "timing": fit.timing,
        "decode": {path: asdict(d) for path, d in fit.decode.items()},
        "prefill": asdict(fit.prefill) if fit.prefill else None,
        "mixed": asdict(fit.mixed) if fit.mixed else None,
        "frontend": asdict(fit.frontend) if fit.frontend else None,
        "drafter": asdict(fit.drafter) if fit.drafter else None,
        "assumed": assumed,
    }


def _default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(type(obj).__name__)


def read_report(profile_path: Path) -> dict[str, Any] | None:
    """The fit report beside a calibrated profile, or None when there is none."""
    path = Path(profile_path).with_suffix(".fit.json")
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise AgentabError(f"{path}: not valid JSON: {exc}") from None
