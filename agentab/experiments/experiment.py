"""Experiment files (TOML): one workload, one GPU count, one engine, two arms, N repeats.

The file format is documented in docs/analysis.md. Validation is strict because an experiment
that silently ignores a typo'd key can compare the wrong things: unknown keys, missing keys,
wrong types, arms that differ in anything but `decode_backend`, and a GPU count that the arms
do not share each end in one `AgentabError` line naming the file, the line and the field.

What may vary between the two arms is deliberately tiny: `name`, `decode_backend`, and in attach
mode (`engine.kind = "http"`, or `"vllm"` with arm URLs) the server's `url` and its `gpu_count`
(which must then equal `[gpus] count`). Everything else lives in the shared tables, so it
cannot differ.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from agentab.analysis.slo import Slo, parse_slo
from agentab.engine.options import (
    DecodeBackend,
    LocalLaunch,
    OptionsError,
    SimulatorOptions,
    decode_options,
    option_names,
    parse_decode_backend,
    toml_name,
)
from agentab.engine.vllm.args import VllmLaunch
from agentab.errors import AgentabError
from agentab.redact import has_credentials

ENGINE_KINDS = ("simulator", "http", "vllm", "local")
# Set outside [engine]: each arm's decode backend, and the simulator's seed (the experiment's
# seed plus the repeat; the local engine's seed, that of its weights, is its own).
_ENGINE_SET_ELSEWHERE = {
    "decode_backend": "each arm's decode_backend ([[arms]])",
    "seed": "the top-level seed (repeat k uses seed + k)",
}
_ENGINE_SET_ELSEWHERE_BY_KIND = {
    "simulator": _ENGINE_SET_ELSEWHERE,
    "local": {"decode_backend": _ENGINE_SET_ELSEWHERE["decode_backend"]},
}
EngineOptions = SimulatorOptions | LocalLaunch | VllmLaunch
HTTP_KEYS = ("model", "api_key_env")  # also the [engine] keys of vLLM attach mode
TOP_KEYS = (
    "name",
    "description",
    "repeats",
    "seed",
    "notes",
    "workload",
    "gpus",
    "replay",
    "engine",
    "analysis",
    "sweep",
    "arms",
)
ARM_KEYS = ("name", "decode_backend", "url", "gpu_count")
WORKLOAD_KEYS = ("path", "format", "generate")
GENERATE_KEYS = ("preset", "sessions", "seed", "config")
GPUS_KEYS = ("count", "ids")
ANALYSIS_KEYS = ("resamples", "confidence", "equivalence_margin", "slo")
SWEEP_KEYS = ("concurrency", "rate")  # closed loop (lanes) or open loop (sessions per second)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Arm:
    """One side of the A/B: a decode backend under a name (attach mode: a server URL; with
    engine kind http, a list of URLs: replicas of one server, each session pinned to one)."""

    name: str
    decode_backend: DecodeBackend
    url: str | tuple[str, ...] | None = None
    gpu_count: int | None = None


@dataclass(frozen=True)
class Sweep:
    """The load points of a sweep: one replay option (`concurrency` or `rate`) and its values,
    in the order the file gives them (the report sorts them)."""

    variable: str
    points: tuple[int | float, ...]

    def label(self, point: int | float) -> str:
        """The point's folder name in the experiment dir, e.g. `concurrency-8`, `rate-0.5`."""
        return f"{self.variable}-{point:g}"


@dataclass(frozen=True)
class Experiment:
    """A parsed, validated experiment file."""

    path: Path
    name: str
    repeats: int
    seed: int
    workload: dict[str, Any]
    gpu_count: int
    gpu_ids: tuple[int, ...]
    replay: dict[str, Any]
    engine_kind: str
    engine: dict[str, Any]
    arms: tuple[Arm, Arm]
    # [engine] decoded (None for kind http and vLLM attach mode); the simulator's and the local
    # engine's carry arm A's decode backend and seed 0: each run sets its own
    engine_options: EngineOptions | None = None
    description: str = ""
    notes: tuple[str, ...] = ()
    resamples: int = 10_000
    confidence: float = 0.95
    equivalence_margin: float = 0.03
    slo: Slo | None = None  # [analysis] slo: the objectives goodput counts against
    sweep: Sweep | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


class _Where:
    """Finds the line of a key in the file text, to name it in errors (tomllib gives none)."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.lines: dict[tuple[str, str], int] = {}
        self.tables: dict[str, int] = {}
        table, counts = "", dict[str, int]()
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            header = re.match(r"^\[\[?\s*([^\]]+?)\s*\]\]?", line)
            if header:
                table = header.group(1)
                if line.startswith("[["):
                    counts[table] = counts.get(table, -1) + 1
                    table = f"{table}.{counts[table]}"
                self.tables.setdefault(table, number)
                continue
            key = re.match(r"^([A-Za-z0-9_\-\"']+)\s*=", line)
            if key:
                name = key.group(1).strip("\"'")
                self.lines.setdefault((table, name), number)
                # inline tables: `generate = { preset = ..., sessions = ... }`
                for inner in re.findall(r"[{,]\s*([A-Za-z0-9_\-]+)\s*=", line):
                    self.lines.setdefault((f"{table}.{name}" if table else name, inner), number)

    def __call__(self, table: str, key: str | None = None) -> str:
        number = self.lines.get((table, key)) if key else None
        number = number or self.tables.get(table)
        return f"{self.path}:{number}" if number else str(self.path)


def _table_name(table: str) -> str:
    return f"[{table}]" if table else "top level"


def _check_keys(data: dict[str, Any], known: tuple[str, ...], table: str, where: _Where) -> None:
    for key in data:
        if key not in known:
            raise AgentabError(
                f"{where(table, key)}: unknown key {key!r} in {_table_name(table)} "
                f"(known: {', '.join(known)})"
            )


def _int(value: Any, name: str, at: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise AgentabError(f"{at}: {name} must be an integer >= {minimum} (got {value!r})")
    return value


def _table(data: dict[str, Any], key: str, where: _Where, *, required: bool) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        if required:
            raise AgentabError(f"{where.path}: missing table [{key}]")
        return {}
    if not isinstance(value, dict):
        raise AgentabError(f"{where('', key)}: {key} must be a table")
    return value


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AgentabError(f"{path}: no such experiment file") from None
    except UnicodeDecodeError as exc:
        raise AgentabError(f"{path}: not UTF-8 text (byte {exc.start}); TOML is UTF-8") from None
    except IsADirectoryError:
        raise AgentabError(f"{path}: is a folder, not an experiment file (.toml)") from None
    except OSError as exc:
        raise AgentabError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AgentabError(f"{path}: invalid TOML ({exc})") from None
    return parse_experiment(data, path, text)


def parse_experiment(data: dict[str, Any], path: Path, text: str = "") -> Experiment:
    """Validate the parsed TOML of an experiment (see module doc)."""
    where = _Where(path, text)
    _check_keys(data, TOP_KEYS, "", where)
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise AgentabError(
            f"{where('', 'name')}: name must be a string of letters, digits, '_', '.', '-' "
            f"(got {name!r})"
        )
    repeats = _int(data.get("repeats", 3), "repeats", where("", "repeats"), 1)
    seed = _int(data.get("seed", 42), "seed", where("", "seed"), 0)
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise AgentabError(f"{where('', 'notes')}: notes must be an array of strings")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise AgentabError(f"{where('', 'description')}: description must be a string")

    workload = _workload(_table(data, "workload", where, required=True), path, where, seed)
    gpus = _table(data, "gpus", where, required=True)
    _check_keys(gpus, GPUS_KEYS, "gpus", where)
    if "count" not in gpus:
        raise AgentabError(f"{where('gpus')}: [gpus] needs count (the GPUs of each arm)")
    gpu_count = _int(gpus["count"], "[gpus] count", where("gpus", "count"), 1)
    ids = gpus.get("ids", [])
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise AgentabError(f"{where('gpus', 'ids')}: [gpus] ids must be device ids (integers >= 0)")
    if ids and len(ids) != gpu_count:
        raise AgentabError(
            f"{where('gpus', 'ids')}: [gpus] ids name {len(ids)} devices but count is {gpu_count}"
        )

    replay = _table(data, "replay", where, required=False)
    if "seed" in replay:
        raise AgentabError(
            f"{where('replay', 'seed')}: [replay] seed is set by the top-level seed "
            "(repeat k of both arms uses seed + k)"
        )
    _check_replay(replay, where)
    sweep = _sweep(_table(data, "sweep", where, required=False), replay, where)

    engine = dict(_table(data, "engine", where, required=True))
    kind = engine.pop("kind", None)
    if kind not in ENGINE_KINDS:
        raise AgentabError(
            f"{where('engine', 'kind')}: [engine] kind must be one of {', '.join(ENGINE_KINDS)} "
            f"(got {kind!r})"
        )
    arms = _arms(data.get("arms"), kind, gpu_count, where)
    _check_one_credential(arms, engine.get("api_key_env"), where)
    attach = arms[0].url is not None
    options = _engine_options(kind, engine, where, attach=attach, gpus=list(ids) or gpu_count)
    if options is not None and not isinstance(options, VllmLaunch):
        options = msgspec.structs.replace(options, decode_backend=arms[0].decode_backend)

    analysis = _table(data, "analysis", where, required=False)
    _check_keys(analysis, ANALYSIS_KEYS, "analysis", where)
    resamples = _int(
        analysis.get("resamples", 10_000), "resamples", where("analysis", "resamples"), 100
    )
    confidence = analysis.get("confidence", 0.95)
    if not isinstance(confidence, float) or not 0.5 <= confidence < 1.0:
        raise AgentabError(
            f"{where('analysis', 'confidence')}: confidence must be a number in [0.5, 1) "
            f"(got {confidence!r})"
        )
    margin = analysis.get("equivalence_margin", 0.03)
    if not isinstance(margin, float) or not 0.0 <= margin < 1.0:
        raise AgentabError(
            f"{where('analysis', 'equivalence_margin')}: equivalence_margin must be a number "
            f"in [0, 1) (0.03 = +-3%; 0 turns the equivalence verdict off), got {margin!r}"
        )
    slo_terms = analysis.get("slo", [])
    if not isinstance(slo_terms, list) or not all(isinstance(t, str) for t in slo_terms):
        raise AgentabError(
            f"{where('analysis', 'slo')}: slo must be a list of strings such as "
            f'["ttft:2s", "itl:50ms"] (got {slo_terms!r})'
        )
    slo = parse_slo(slo_terms, where=f"{where('analysis', 'slo')}: [analysis] slo")

    return Experiment(
        path=path,
        name=name,
        repeats=repeats,
        seed=seed,
        workload=workload,
        gpu_count=gpu_count,
        gpu_ids=tuple(ids),
        replay=replay,
        engine_kind=kind,
        engine=engine,
        arms=arms,
        engine_options=options,
        description=description,
        notes=tuple(notes),
        resamples=resamples,
        confidence=confidence,
        equivalence_margin=margin,
        slo=slo,
        sweep=sweep,
        raw=data,
    )


def _workload(table: dict[str, Any], path: Path, where: _Where, seed: int) -> dict[str, Any]:
    _check_keys(table, WORKLOAD_KEYS, "workload", where)
    if ("path" in table) == ("generate" in table):
        raise AgentabError(
            f"{where('workload')}: [workload] needs exactly one of path (a trace file) or "
            "generate (a generator table)"
        )
    if "path" in table:
        trace = table["path"]
        if not isinstance(trace, str):
            raise AgentabError(f"{where('workload', 'path')}: [workload] path must be a string")
        fmt = table.get("format")
        if fmt is not None and fmt not in ("agentx", "mooncake", "native"):
            raise AgentabError(
                f"{where('workload', 'format')}: [workload] format must be agentx, mooncake "
                f"or native (got {fmt!r})"
            )
        resolved = Path(trace) if Path(trace).is_absolute() else path.parent / trace
        return {"path": str(resolved), "format": fmt}
    if "format" in table:
        raise AgentabError(f"{where('workload', 'format')}: format applies only to path")
    gen = table["generate"]
    if not isinstance(gen, dict):
        raise AgentabError(f"{where('workload', 'generate')}: generate must be a table")
    _check_keys(gen, GENERATE_KEYS, "workload.generate", where)
    at = where("workload.generate", "sessions")
    if "sessions" not in gen:
        raise AgentabError(f"{at}: [workload.generate] needs sessions")
    config = gen.get("config", {})
    if not isinstance(config, dict):
        raise AgentabError(f"{where('workload.generate', 'config')}: config must be a table")
    return {
        "generate": {
            "preset": str(gen.get("preset", "agentx-coding")),
            "sessions": _int(gen["sessions"], "sessions", at, 1),
            "seed": _int(gen.get("seed", seed), "seed", where("workload.generate", "seed"), 0),
            "config": config,
        }
    }


def _check_replay(replay: dict[str, Any], where: _Where) -> None:
    from agentab.replay.options import ReplayOptions

    for key in replay:
        try:
            ReplayOptions.from_mapping({key: replay[key]}, where="[replay]")
        except AgentabError as exc:
            raise AgentabError(f"{where('replay', key)}: {exc}") from None
    try:
        ReplayOptions.from_mapping(replay, where="[replay]")
    except AgentabError as exc:
        raise AgentabError(f"{where('replay')}: {exc}") from None


def _sweep(table: dict[str, Any], replay: dict[str, Any], where: _Where) -> Sweep | None:
    """The [sweep] table: exactly one of concurrency (integers >= 1) or rate (numbers > 0),
    distinct values; the swept option must not also be fixed in [replay]."""
    if not table:
        return None
    _check_keys(table, SWEEP_KEYS, "sweep", where)
    if len(table) != 1:
        raise AgentabError(
            f"{where('sweep')}: [sweep] needs exactly one of concurrency (closed loop) or rate "
            "(open loop)"
        )
    ((variable, values),) = table.items()
    at = where("sweep", variable)
    if not isinstance(values, list) or not values:
        raise AgentabError(f"{at}: [sweep] {variable} must be a non-empty array")
    for value in values:
        if variable == "concurrency":
            _int(value, "[sweep] concurrency values", at, 1)
        elif isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise AgentabError(f"{at}: [sweep] rate values must be numbers > 0 (got {value!r})")
    if len(set(values)) != len(values):
        raise AgentabError(f"{at}: [sweep] {variable} lists a value twice ({values})")
    if variable in replay:
        raise AgentabError(
            f"{where('replay', variable)}: [replay] {variable} is set by [sweep] {variable}; "
            "remove it from [replay]"
        )
    if variable == "concurrency" and ("rate" in replay or "time_scale" in replay):
        key = "rate" if "rate" in replay else "time_scale"
        raise AgentabError(
            f"{where('replay', key)}: a concurrency sweep is closed loop; [replay] {key} makes "
            "it open loop"
        )
    if variable == "rate" and "time_scale" in replay:
        raise AgentabError(
            f"{where('replay', 'time_scale')}: a rate sweep sets the arrival rate; remove "
            "[replay] time_scale"
        )
    return Sweep(variable, tuple(values))


def _engine_options(
    kind: str, engine: dict[str, Any], where: _Where, *, attach: bool, gpus: int | list[int]
) -> EngineOptions | None:
    """The [engine] table as its kind's options struct; an error names the key and its line."""
    if kind == "http" or attach:
        _check_keys(engine, HTTP_KEYS, "engine", where)
        return None
    if kind == "vllm":  # launch mode
        from agentab.engine.vllm.args import check_gpus, gpu_ids_of

        launch = _decode_engine(
            where, engine, lambda: VllmLaunch.from_mapping(engine, name=toml_name("engine"))
        )
        try:
            check_gpus(launch, gpu_ids_of(gpus))  # refused before any server starts
        except AgentabError as exc:
            raise AgentabError(f"{where('engine')}: {exc}") from None
        return launch
    cls: type[SimulatorOptions | LocalLaunch] = (
        SimulatorOptions if kind == "simulator" else LocalLaunch
    )
    elsewhere = _ENGINE_SET_ELSEWHERE_BY_KIND[kind]
    for key, owner in elsewhere.items():
        if key in engine:
            raise AgentabError(f"{where('engine', key)}: engine.{key} is set by {owner}")
    known = [name for name in option_names(cls) if name not in elsewhere]
    options = _decode_engine(
        where,
        engine,
        lambda: decode_options(cls, engine, name=toml_name("engine"), known=known),
    )
    if isinstance(options, LocalLaunch):
        count = len(gpus) if isinstance(gpus, list) else gpus
        if count != options.tp:
            raise AgentabError(
                f"{where('gpus')}: the local engine runs one device per tensor-parallel rank; "
                f"[gpus] count {count} is not the engine's tp {options.tp}"
            )
    return options


_OptionsT = TypeVar("_OptionsT")


def _decode_engine(
    where: _Where, engine: dict[str, Any], decode: Callable[[], _OptionsT]
) -> _OptionsT:
    """`decode()`, with a bad option's error led by its file and line."""
    try:
        return decode()
    except OptionsError as exc:
        at = where("engine")
        if exc.field is not None:  # (a dotted field is in a sub-table: [engine.speculative_config])
            table, _, key = f"engine.{exc.field}".rpartition(".")
            at = where(table, key)
        raise AgentabError(f"{at}: {exc}") from None
    except AgentabError as exc:
        raise AgentabError(f"{where('engine')}: {exc}") from None


def _toml_type(value: Any) -> str:
    """How TOML calls the type of a parsed value, for errors."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "a date or time"


def _arms(arms: Any, kind: str, gpu_count: int, where: _Where) -> tuple[Arm, Arm]:
    if not isinstance(arms, list) or len(arms) != 2:
        count = len(arms) if isinstance(arms, list) else 0
        raise AgentabError(f"{where.path}: need exactly two [[arms]] (found {count})")
    parsed = []
    for i, arm in enumerate(arms):
        table = f"arms.{i}"
        if not isinstance(arm, dict):
            raise AgentabError(
                f"{where('', 'arms')}: arm {i + 1} is {_toml_type(arm)}, not a table: write each "
                "arm as an [[arms]] table (decode_backend = ...)"
            )
        for key in arm:
            if key not in ARM_KEYS:
                raise AgentabError(
                    f"{where(table, key)}: arms may differ only in decode_backend, but arm "
                    f"{i + 1} sets {key!r}; put it in the shared [engine]/[replay]/[gpus] tables"
                )
        try:
            backend = parse_decode_backend(arm.get("decode_backend"), f"arms[{i}].decode_backend")
        except AgentabError as exc:
            raise AgentabError(f"{where(table, 'decode_backend')}: {exc}") from None
        name = arm.get("name", backend.value)
        if not isinstance(name, str) or not _NAME.match(name):
            raise AgentabError(f"{where(table, 'name')}: arm name {name!r} is not a plain name")
        url = arm.get("url")
        if kind == "http" and isinstance(url, list):
            url = tuple(url)  # replicas of one server (agentab.replay.targets.routed)
            if not url or not all(isinstance(u, str) and _is_http(u) for u in url):
                raise AgentabError(
                    f"{where(table, 'url')}: an http arm's url list needs one or more "
                    "http://host:port strings (the replicas of one server)"
                )
        elif kind == "http" or (kind == "vllm" and url is not None):
            if not isinstance(url, str) or not _is_http(url):
                lists = "; a list of replica URLs is for engine kind http" if kind == "vllm" else ""
                raise AgentabError(
                    f"{where(table, 'url')}: an {kind} arm needs url (http://host:port{lists})"
                )
            arm_gpus = _int(arm.get("gpu_count", gpu_count), "gpu_count", where(table), 1)
            if arm_gpus != gpu_count:
                raise AgentabError(
                    f"{where(table, 'gpu_count')}: arm {name!r} runs on {arm_gpus} GPUs but "
                    f"[gpus] count is {gpu_count}: both arms must use the same GPU count"
                )
        elif url is not None or "gpu_count" in arm:
            key = "url" if url is not None else "gpu_count"
            raise AgentabError(
                f"{where(table, key)}: {key} belongs to attach mode (engine kind http or vllm) only"
            )
        parsed.append(Arm(name, backend, url, gpu_count if url is not None else None))
    if (parsed[0].url is None) != (parsed[1].url is None):
        raise AgentabError(
            f"{where('arms.1')}: give url to both arms (attach mode) or to neither (launch mode)"
        )
    if parsed[0].name == parsed[1].name:
        raise AgentabError(
            f"{where('arms.1', 'name')}: both arms are named {parsed[0].name!r}; give an A/A "
            "experiment two names"
        )
    return parsed[0], parsed[1]


def _is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def _check_one_credential(arms: tuple[Arm, Arm], api_key_env: Any, where: _Where) -> None:
    """A URL's user:password and [engine] api_key_env both set the Authorization header: the
    server would get one of them, so the file must choose."""
    if not api_key_env:
        return
    for i, arm in enumerate(arms):
        urls = (arm.url,) if isinstance(arm.url, str) else arm.url or ()
        if any(has_credentials(u) for u in urls):
            raise AgentabError(
                f"{where(f'arms.{i}', 'url')}: arm {arm.name!r}: the url carries credentials "
                f"(user:password@) and [engine] api_key_env = {api_key_env!r} sends a key too; "
                "give the server one of them"
            )
