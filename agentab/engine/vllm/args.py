"""What one vLLM arm is started with: the launch options and the exact argument list.

An A/B is only meaningful when the two arms differ in the decode backend and nothing else, so the
argument list is built here, in one place, from one `VllmLaunch` shared by both arms: the only
arm-specific input is `decode_backend`, which is merged into the `--additional-config` JSON
(sorted keys, so the rest of the bytes match). Everything that would silently break the
comparison (a second source of the parallel sizes, a user-set decode backend, a parallel layout
that does not use exactly the experiment's GPUs) is refused here, before any process starts.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from agentab.engine.options import (
    DECODE_BACKENDS,
    PositiveFloat,
    PositiveInt,
    decode_options,
    parse_decode_backend,
)
from agentab.errors import AgentabError

# The tiny MoE config shipped with agentab (random weights via `--load-format dummy`).
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
BUILTIN_PREFIX = "agentab:"

# Flags the launcher owns; a user copy would make the arms or the guard's facts disagree.
_OWNED_FLAGS: dict[str, str] = {
    "--model": "model",
    "--host": "host",
    "--port": "port (agentab picks a free one)",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "-pp": "pipeline_parallel_size",
    "--data-parallel-size": "data_parallel_size",
    "-dp": "data_parallel_size",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--no-enable-prefix-caching": "enable_prefix_caching",
}
# A flag whose last word names a secret (`--api-key`, `--hf-token`), not `--skip-tokenizer-init`.
_SECRET_WORDS = "key|keys|token|tokens|secret|password|passwd|pass|pat|credential|credentials|auth"
_SECRET_FLAG = re.compile(rf"(?:^|[-_])(?:{_SECRET_WORDS})$", re.IGNORECASE)
_SECRET_ENV = re.compile(rf"(?:^|_)(?:{_SECRET_WORDS})(?:$|_)", re.IGNORECASE)
REDACTED = "<redacted>"
__all__ = ["DECODE_BACKENDS", "VllmLaunch", "build_args", "check_gpus", "gpu_ids_of", "redact"]


class VllmLaunch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to start the vLLM server of an arm (everything but the decode backend and the GPUs).

    `command` is the launcher prefix: `vllm serve` by default, or e.g.
    `/path/venv/bin/python -m vllm.entrypoints.openai.api_server`; agentab always passes the model
    as `--model`, which both accept. `server_args` are passed through unchanged and identically
    to both arms. `env` adds environment variables to the server's (recorded, secrets redacted).
    Both word lists may be given as one shell-quoted string.
    """

    model: Annotated[str, Meta(min_length=1)]
    command: tuple[str, ...] = ("vllm", "serve")
    server_args: tuple[str, ...] = ()
    tensor_parallel_size: PositiveInt = 1
    pipeline_parallel_size: PositiveInt = 1
    data_parallel_size: PositiveInt = 1
    enable_prefix_caching: bool = True
    host: str = "127.0.0.1"
    startup_timeout_s: PositiveFloat = 900.0
    stop_grace_s: PositiveFloat = 30.0
    env: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # the words of a command line given as one string (a TOML string or a keyword)
        for name in ("command", "server_args"):
            value: Any = getattr(self, name)
            words = shlex.split(value) if isinstance(value, str) else value
            msgspec.structs.force_setattr(self, name, tuple(str(x) for x in words))
        if not self.command:
            raise AgentabError("vllm launch: `command` is empty")
        _check_server_args(self.server_args)

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, Any], name: Callable[[str], str] = str
    ) -> VllmLaunch:
        """Decode an experiment file's table (`agentab.engine.options.decode_options`; a bad
        key raises `OptionsError` naming it by `name`)."""
        table = dict(mapping)
        for words in ("command", "server_args"):
            if isinstance(table.get(words), str):
                table[words] = shlex.split(table[words])
        return decode_options(cls, table, name=name)

    @property
    def gpus_needed(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


def _flag_name(arg: str) -> str:
    return arg.split("=", 1)[0]


def _check_server_args(server_args: Sequence[str]) -> None:
    for arg in server_args:
        name = _flag_name(arg)
        if name in _OWNED_FLAGS:
            raise AgentabError(
                f"vllm launch: server_args must not contain {name}; "
                f"set `{_OWNED_FLAGS[name]}` in the experiment instead"
            )
        if name.startswith("--additional-config."):
            raise AgentabError(
                f"vllm launch: server_args: write {name} as --additional-config JSON "
                "(agentab merges decode_backend into it)"
            )
    _user_additional_config(server_args)  # validates the JSON


def resolve_model(model: str) -> tuple[str, str | None]:
    """`agentab:NAME` -> (shipped config path, served name `agentab:NAME`); else (model, None).

    The server answers to exactly the `model` string the experiment names, as vLLM does for
    a path or a hub id, so clients can pass that string as the request's model.
    """
    if not model.startswith(BUILTIN_PREFIX):
        return model, None
    name = model[len(BUILTIN_PREFIX) :]
    path = MODELS_DIR / name
    if not (path / "config.json").is_file():
        shipped = sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())
        raise AgentabError(
            f"vllm launch: no built-in model {name!r} (shipped: {', '.join(shipped)})"
        )
    return str(path), model


def _user_additional_config(server_args: Sequence[str]) -> tuple[int, int, dict[str, Any]] | None:
    """(start index, number of list items, parsed JSON) of the user's --additional-config."""
    found = None
    for i, arg in enumerate(server_args):
        name = _flag_name(arg)
        if name != "--additional-config":
            continue
        if found is not None:
            raise AgentabError("vllm launch: server_args give --additional-config twice")
        if "=" in arg:
            raw, width = arg.split("=", 1)[1], 1
        elif i + 1 < len(server_args):
            raw, width = server_args[i + 1], 2
        else:
            raise AgentabError("vllm launch: server_args end with --additional-config and no JSON")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise AgentabError(
                f"vllm launch: --additional-config is not JSON ({exc.msg} at column {exc.colno})"
            ) from None
        if not isinstance(value, dict):
            raise AgentabError("vllm launch: --additional-config must be a JSON object")
        if "decode_backend" in value:
            raise AgentabError(
                "vllm launch: --additional-config must not set decode_backend; "
                "it is the arm's `decode_backend`"
            )
        found = (i, width, value)
    return found


def check_gpus(launch: VllmLaunch, gpu_ids: Sequence[int]) -> None:
    """Refuse a parallel layout that does not use exactly the experiment's GPUs."""
    count = len(gpu_ids)
    if len(set(gpu_ids)) != count:
        raise AgentabError(f"vllm launch: gpus lists a device twice: {list(gpu_ids)}")
    if launch.gpus_needed != count:
        layout = (
            f"tensor_parallel_size {launch.tensor_parallel_size} x "
            f"pipeline_parallel_size {launch.pipeline_parallel_size}"
        )
        if launch.data_parallel_size != 1:
            layout += f" x data_parallel_size {launch.data_parallel_size}"
        raise AgentabError(
            f"vllm launch: {layout} = {launch.gpus_needed} GPUs, but the experiment's gpus "
            f"give {count} ({','.join(map(str, gpu_ids))}); they must be equal"
        )


def gpu_ids_of(gpus: int | Sequence[int]) -> list[int]:
    """The experiment's `gpus`: a count (devices 0..n-1) or explicit device ids."""
    if isinstance(gpus, bool):
        raise AgentabError(f"gpus: expected a count or a list of device ids, got {gpus!r}")
    if isinstance(gpus, int):
        if gpus < 1:
            raise AgentabError(f"gpus: must be >= 1, got {gpus}")
        return list(range(gpus))
    ids = list(gpus)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise AgentabError(f"gpus: expected device ids (integers >= 0), got {ids!r}")
    return ids


def build_args(launch: VllmLaunch, decode_backend: str, port: int) -> list[str]:
    """The exact argument list of one arm (command prefix included)."""
    backend = parse_decode_backend(decode_backend)
    model, served_name = resolve_model(launch.model)
    args = list(launch.command)
    args += ["--model", model, "--host", launch.host, "--port", str(port)]
    if served_name and not any(_flag_name(a) == "--served-model-name" for a in launch.server_args):
        args += ["--served-model-name", served_name]
    args += ["--tensor-parallel-size", str(launch.tensor_parallel_size)]
    args += ["--pipeline-parallel-size", str(launch.pipeline_parallel_size)]
    if launch.data_parallel_size != 1:
        args += ["--data-parallel-size", str(launch.data_parallel_size)]
    if launch.enable_prefix_caching:
        args.append("--enable-prefix-caching")
    else:
        args.append("--no-enable-prefix-caching")
    user = list(launch.server_args)
    found = _user_additional_config(user)
    extra: dict[str, Any] = {}
    if found is not None:
        start, width, extra = found
        del user[start : start + width]
    if not any(_flag_name(a).endswith("enable-prompt-tokens-details") for a in user):
        # Without it vLLM's usage omits cached tokens and the client-side hit ratio is unknown.
        user.append("--enable-prompt-tokens-details")
    config = {**extra, "decode_backend": backend.value}
    args += user
    args += ["--additional-config", json.dumps(config, sort_keys=True, separators=(",", ":"))]
    return args


def redact(args: Sequence[str]) -> list[str]:
    """The argument list with the values of key/token/secret flags replaced."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name = _flag_name(arg)
        if arg.startswith("-") and _SECRET_FLAG.search(name.lstrip("-")):
            if "=" in arg:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(_redact_json(arg))
    return out


def _redact_json(arg: str) -> str:
    """A JSON object argument (`--additional-config '{...}'`) with secret-named keys hidden."""
    if not arg.lstrip().startswith("{"):
        return arg
    try:
        value = json.loads(arg)
    except ValueError:
        return arg
    hidden = _hide_secrets(value)
    return arg if hidden == value else json.dumps(hidden, separators=(",", ":"))


def _hide_secrets(value: object) -> object:
    if isinstance(value, dict):
        return {
            k: REDACTED if _SECRET_FLAG.search(str(k)) else _hide_secrets(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_hide_secrets(v) for v in value]
    return value


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (REDACTED if _SECRET_ENV.search(k) else v) for k, v in sorted(env.items())}
