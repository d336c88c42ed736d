"""Typed engine options: one struct per engine kind, decoded from TOML tables, flags and kwargs.

Every engine (the simulator, the local engine, a vLLM arm) is configured from an untyped
mapping: an experiment file's `[engine]` table, a command's flags, a builder's keyword
arguments. Each kind's options are a `msgspec.Struct` here (the vLLM launch's is
`engine.vllm.args.VllmLaunch`), and `decode_options` is the one way to turn a mapping into one:
msgspec checks types, ranges and unknown keys, and its error is rewritten into one line that
names the field as the caller spells it (`engine.decode_backend: expected one of auto,
latency_specialized, got 'fast'`). Rules that relate several fields or need the loaded profile
or model (drafts against the acceptance model, async scheduling) stay with the builder that
knows them and name the field the same way.

Nothing here imports torch, so an experiment file of any engine kind is checked where torch
is not installed.
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from agentab.errors import AgentabError


class DecodeBackend(enum.StrEnum):
    """Which decode path an engine may use for the steps it supports (docs/engine.md).

    The value is what the user writes (TOML, flags, vLLM's `--additional-config`) and what
    manifests record; being a `str`, a member compares equal to that string.
    """

    AUTO = "auto"
    LATENCY_SPECIALIZED = "latency_specialized"

    @property
    def specialized(self) -> bool:
        """Whether steps the specialized path supports run on it."""
        return self is DecodeBackend.LATENCY_SPECIALIZED


DECODE_BACKENDS: tuple[str, ...] = tuple(b.value for b in DecodeBackend)

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
PositiveFloat = Annotated[float, Meta(gt=0.0)]
Device = Annotated[str, Meta(pattern=r"^(cpu|cuda(:[0-9]+)?)$")]


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every in-process engine takes: the decode backend, the largest step it sends to
    the specialized path, and the engine's seed.

    `specialized_max_tokens` is per-shape dispatch: under `latency_specialized`, a step whose
    padded token count exceeds it runs the standard path, like any step the specialized path
    does not support. None keeps vLLM's rule (the profile's limit; 64 on the local engine).
    Where a decoder loses to the standard path from some shape up (`agentab kernels bench`
    says where), setting it there measures the backend a user would deploy: the specialized
    path only where it wins. The report's share of decode steps on the specialized path says
    how much of the run it then served.
    """

    decode_backend: DecodeBackend = DecodeBackend.AUTO
    specialized_max_tokens: Annotated[int, Meta(ge=1, le=64)] | None = None
    seed: NonNegativeInt = 0

    def specialized_limit(self, default: int) -> int:
        """The padded token count up to which the specialized path may serve a step."""
        if self.specialized_max_tokens is None:
            return default
        return min(default, self.specialized_max_tokens)


class SimulatorOptions(EngineOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`build_simulator`'s options (docs/engine.md): the profile, spec decode, limits, noise.

    `kv_blocks` None takes the profile's capacity; `fast_forward` False steps one at a time;
    `step_noise` / `run_noise` are log-scale sigmas of a real engine's timing noise.
    """

    profile: str
    num_draft_tokens: NonNegativeInt = 0
    acceptance_length: Annotated[float, Meta(ge=1.0)] | None = None
    acceptance_probs: tuple[Fraction, ...] | None = None
    max_num_seqs: PositiveInt = 1024
    max_num_batched_tokens: PositiveInt = 8192
    kv_blocks: PositiveInt | None = None
    block_size: PositiveInt = 16
    fast_forward: bool = True
    step_noise: Fraction = 0.0
    run_noise: Fraction = 0.0
    noise_seed: int = 0


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The local engine's speculative decoding, under vLLM's `--speculative-config` names.

    Why vLLM's names: an experiment that runs vLLM arms and local-engine arms states spec
    decoding once, the same way (docs/engine.md, "Speculative decoding on the local engine").
    `method` is the drafter: `early_exit` runs the target's first `draft_layers` layers (their
    KV is the target's own) with its final norm and LM head, k times, one draft token each; at
    `draft_layers` = the model's depth the drafter is the target itself. `rejection_sample_method`
    `standard` verifies greedily (lossless); `synthetic` accepts by vLLM's synthetic rates
    (exactly one of `synthetic_acceptance_length` or `synthetic_acceptance_rates`, the
    unconditional per-position rates), whatever the drafts are.
    """

    method: Literal["early_exit"] = "early_exit"
    num_speculative_tokens: PositiveInt
    draft_layers: PositiveInt = 1
    rejection_sample_method: Literal["standard", "synthetic"] = "standard"
    synthetic_acceptance_length: Annotated[float, Meta(ge=1.0)] | None = None
    synthetic_acceptance_rates: tuple[Fraction, ...] | None = None

    def __post_init__(self) -> None:
        """The rules between fields (vLLM's `_resolve_synthetic_acceptance_rates`), each error
        naming its field in backquotes first (`explain` puts the table's name in front)."""
        k = self.num_speculative_tokens
        length, rates = self.synthetic_acceptance_length, self.synthetic_acceptance_rates
        if self.rejection_sample_method != "synthetic":
            for name, value in (("synthetic_acceptance_length", length),
                                ("synthetic_acceptance_rates", rates)):  # fmt: skip
                if value is not None:
                    raise ValueError(f"`{name}`: only with rejection_sample_method = 'synthetic'")
            return
        if (length is None) == (rates is None):
            raise ValueError(
                "`rejection_sample_method`: 'synthetic' needs exactly one of "
                "synthetic_acceptance_length or synthetic_acceptance_rates"
            )
        if length is not None and not length <= k + 1:
            raise ValueError(
                f"`synthetic_acceptance_length`: must be in [1, {k + 1}] "
                f"(1 + num_speculative_tokens), got {length!r}"
            )
        if rates is not None:
            if len(rates) != k:
                raise ValueError(
                    f"`synthetic_acceptance_rates`: needs {k} values (one per draft position), "
                    f"got {len(rates)}"
                )
            if any(b > a for a, b in itertools.pairwise(rates)):
                raise ValueError(
                    f"`synthetic_acceptance_rates`: must be non-increasing, got {list(rates)}"
                )

    def describe(self) -> dict[str, object]:
        """What a run manifest records (every field, so two arms' configs compare field by
        field in the guard)."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


class LocalOptions(EngineOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`build_local_engine`'s options (docs/engine.md, "The local engine").

    None takes the preset's or the device's default (`engine.local.build`). `prefill_graphs`
    runs prefill and mixed steps of up to `max_num_batched_tokens` tokens in piecewise CUDA
    graphs (engine.local.piecewise; on the CPU the same pieces run eagerly); None turns them on
    where they pay, a single GPU (an eager prefill step there waits on its kernel launches), and
    off on the CPU, which has no launches to save.
    """

    preset: str
    num_layers: PositiveInt | None = None
    weight_sets: PositiveInt | None = None
    kv_blocks: PositiveInt | None = None
    block_size: PositiveInt = 16
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt = 2048
    device: Device | None = None
    max_model_len: PositiveInt | None = None
    tp: PositiveInt = 1
    speculative_config: SpeculativeConfig | None = None
    prefill_graphs: bool | None = None


class LocalLaunch(LocalOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A local-engine arm of an experiment: the engine's options and how long it may take to
    start (its own `agentab serve --engine local` process, `engine.local.launch`)."""

    startup_timeout_s: PositiveFloat = 600.0


class _Backend(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    decode_backend: DecodeBackend


def parse_decode_backend(value: object, name: str = "decode_backend") -> DecodeBackend:
    """A decode backend given on its own (an arm's, a launcher's argument), checked and named
    in errors as every engine's options are."""
    arm = decode_options(_Backend, {"decode_backend": value}, name=lambda _field: name)
    return arm.decode_backend


OptionsT = TypeVar("OptionsT", bound=msgspec.Struct)


def options_file_table(value: str, table: str, flag: str) -> dict[str, Any] | None:
    """The `[table]` of a TOML file when a flag's value names one (None when it does not).

    Why: `agentab acceptance -o FILE` writes measured acceptance as the options read it
    (`[speculative_config]` for the local engine, `[simulator]` for the simulator), and a flag
    that takes the file replays the measurement without a hand-copied list of rates."""
    import tomllib
    from pathlib import Path

    path = Path(value)
    if value.lstrip().startswith(("{", "[")):
        return None
    if not path.is_file():
        if path.suffix == ".toml":
            raise AgentabError(f"{flag} {path}: no such file")
        return None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AgentabError(f"{flag} {path}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise AgentabError(f"{flag} {path}: not TOML ({exc})") from None
    found = data.get(table)
    if not isinstance(found, dict):
        raise AgentabError(
            f"{flag} {path}: no [{table}] table (`agentab acceptance -o FILE` writes one)"
        )
    return found


class OptionsError(AgentabError):
    """A bad option: the message names it; `field` is its name in the struct (a file's
    loader looks up the field's line with it; dotted inside a sub-table:
    `speculative_config.num_speculative_tokens`), None when no one field is at fault."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field


def option_names(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    """The fields of an options struct, in declaration order."""
    return cls.__struct_fields__


def decode_options(
    cls: type[OptionsT],
    data: Mapping[str, Any],
    *,
    name: Callable[[str], str] = str,
    known: Iterable[str] | None = None,
) -> OptionsT:
    """`data` as a `cls`, or an `OptionsError` naming the field by `name(field)`.

    None values mean "the default" (keyword callers pass them for options they leave unset).
    Types are strict, as TOML's are (no number from a string, no bool for an int). `known`
    is the list an unknown key's error offers (default: every field of `cls`), for callers
    that set some fields themselves.
    """
    given = {key: value for key, value in data.items() if value is not None}
    try:
        return msgspec.convert(given, cls)
    except msgspec.ValidationError as exc:
        field, message = explain(exc, cls, given, name, known)
        raise OptionsError(message, field) from None


def flag_name(field: str) -> str:
    """A field's command-line flag: `num_draft_tokens` -> `--num-draft-tokens`."""
    return "--" + field.replace("_", "-")


def toml_name(table: str) -> Callable[[str], str]:
    """Fields of a TOML table by their dotted name: `toml_name("engine")("seed")` ->
    `engine.seed`."""
    return lambda field: f"{table}.{field}"


_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")
_PART = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_GOT_TYPE = re.compile(r", got `[^`]+`$")
_RULE = re.compile(r"^`(?P<field>[A-Za-z_][A-Za-z0-9_]*)`: (?P<rest>.*)$")


def explain(
    exc: msgspec.ValidationError,
    cls: type[msgspec.Struct],
    data: Mapping[str, Any],
    name: Callable[[str], str] = str,
    known: Iterable[str] | None = None,
) -> tuple[str | None, str]:
    """msgspec's validation error as (the field, one line: the field as `name` spells it,
    what it expects, what it got)."""
    match = _AT.match(str(exc))
    message = match["message"] if match else str(exc)
    path = (match["path"] if match else "") or ""
    # msgspec names a mapping's bad value `[...]`, not by its key: name the mapping instead
    path, in_values = path.partition("[...]")[0], "[...]" in path
    parts = [(key, int(index)) if index else (key, None) for key, index in _PART.findall(path)]
    if parts and parts[0][0]:  # inside a field that is itself a struct (a TOML sub-table)
        where = name(parts[0][0]) + "".join(
            f".{key}" if index is None else f"[{index}]" for key, index in parts[1:]
        )
        inner = _struct_at(cls, [key for key, index in parts if index is None])
        dotted = ".".join(key for key, index in parts if index is None)
        if unknown := _UNKNOWN.match(message):
            listed = ", ".join(option_names(inner) if inner else ())
            sub = unknown["field"]
            return f"{dotted}.{sub}", f"{where}.{sub}: unknown option (known: {listed})"
        if missing := _MISSING.match(message):
            return dotted, f"{where}.{missing['field']}: missing (required)"
        if rule := _RULE.match(message):  # a struct's own check (__post_init__)
            return f"{dotted}.{rule['field']}", f"{where}.{rule['field']}: {rule['rest']}"
    if unknown := _UNKNOWN.match(message):
        listed = ", ".join(option_names(cls) if known is None else known)
        return unknown["field"], f"{name(unknown['field'])}: unknown option (known: {listed})"
    if missing := _MISSING.match(message):
        return missing["field"], f"{name(missing['field'])}: missing (required)"
    if not parts or parts[0][0] == "":
        return None, message[:1].lower() + message[1:]
    field = ".".join(key for key, index in parts if index is None)
    label = name(parts[0][0]) + "".join(
        f".{key}" if index is None else f"[{index}]" for key, index in parts[1:]
    )
    inner = _struct_at(cls, [key for key, index in parts[:-1] if index is None])
    if inner is not None and len(parts) > 1:  # a sub-table's enum or Literal field
        choices = _choices(inner, parts[-1][0])
        if choices:
            listed = ", ".join(str(c) for c in choices)
            return field, f"{label}: expected one of {listed}, got {_value_at(data, parts)!r}"
    value = _value_at(data, parts)
    choices = _choices(cls, field)
    if choices and len(parts) == 1:  # a wrong value or a wrong type: either way, the choices
        listed = ", ".join(str(c) for c in choices)
        return field, f"{label}: expected one of {listed}, got {value!r}"
    expected = _GOT_TYPE.sub("", message).replace("`", "").replace(" | null", "")
    if in_values:
        expected += " values"
    return field, f"{label}: {expected[:1].lower()}{expected[1:]}, got {value!r}"


def _value_at(data: Mapping[str, Any], parts: Iterable[tuple[str, int | None]]) -> Any:
    value: Any = data
    for key, index in parts:
        try:
            value = value[key] if index is None else value[index]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _struct_at(cls: type[msgspec.Struct], keys: list[str]) -> type[msgspec.Struct] | None:
    """The struct type reached from `cls` through the fields `keys` (None: not a struct)."""
    current: type[msgspec.Struct] | None = cls
    for key in keys:
        if current is None:
            return None
        info = msgspec.inspect.type_info(current)
        assert isinstance(info, msgspec.inspect.StructType)
        current = None
        for f in info.fields:
            if f.name != key:
                continue
            types = f.type.types if isinstance(f.type, msgspec.inspect.UnionType) else (f.type,)
            for t in types:
                if isinstance(t, msgspec.inspect.StructType):
                    current = t.cls
    return current


def _choices(cls: type[msgspec.Struct], field: str) -> tuple[object, ...]:
    """The values an enum or Literal field accepts."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    for f in info.fields:
        if f.name != field:
            continue
        types = f.type.types if isinstance(f.type, msgspec.inspect.UnionType) else (f.type,)
        for t in types:
            if isinstance(t, msgspec.inspect.EnumType):
                return tuple(member.value for member in t.cls)
            if isinstance(t, msgspec.inspect.LiteralType):
                return tuple(t.values)
    return ()
