"""HardwareProfile: what one GPU configuration costs per step, loaded from a validated TOML file.

The simulator has no GPU; a profile is its cost model. Everything that differs between decode
paths lives here (per-layer time tables, fixed per-step costs), so the A/B effect the simulator
shows is exactly what the profile encodes. A profile names its `gpu_count`: both arms of an A/B
must use the same profile, hence the same GPU count. The file format is documented in
docs/engine.md; units are in the key names (`_us`, `_per_s`, `_bytes`).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from agentab.errors import AgentabError

PATHS = ("standard", "specialized")
STATUSES = ("published-derived", "measured", "unmeasured-placeholder")


@dataclass(frozen=True)
class DecodeTable:
    """Per-layer time of one decode path over (padded) batch tokens, interpolated linearly."""

    batch_tokens: np.ndarray
    layer_time_us: np.ndarray
    step_fixed_us: float

    def layer_us(self, tokens: float) -> float:
        return float(np.interp(tokens, self.batch_tokens, self.layer_time_us))

    @property
    def max_tokens(self) -> int:
        return int(self.batch_tokens[-1])


@dataclass(frozen=True)
class HardwareProfile:
    """A validated profile. `content_hash` (sha256 of the file bytes) identifies it in manifests."""

    name: str
    status: str
    source: str
    content_hash: str
    model: str
    gpu_name: str
    gpu_count: int
    tp: int
    num_layers: int
    kv_layers: int
    kv_block_size_tokens: int
    kv_capacity_blocks: int
    kv_bytes_per_token_per_layer: float
    hbm_read_bytes_per_s: float
    cuda_graph_max_tokens: int
    standard: DecodeTable
    specialized: DecodeTable
    specialized_max_padded_tokens: int
    specialized_max_requests_by_q: tuple[int, ...]
    drafter_step_us: float
    prefill_tokens_per_s_per_gpu: float
    attention_flops_per_token_pair: float
    attention_flops_per_s_per_gpu: float
    # A prefill row's cost per token of its computed context (cached prefix, earlier chunks),
    # per step, whatever the chunk's length: MLA prefill expands each cached latent into
    # per-head keys and values before attending.
    prefill_context_token_us: float = 0.0
    # The drafter's cost per row it drafts for, per step, beside drafter_step_us: a drafter
    # that runs decoder layers k times (EAGLE, MTP, early exit) costs more with more rows.
    drafter_row_us: float = 0.0
    # Per context token a verify row reads, per draft token it verifies: an attention that
    # treats each of a verify row's 1 + k query tokens as a decode query of its own reads the
    # row's KV 1 + k times, not once (the local engine's does; FlashMLA-style kernels that pack
    # the query tokens read it once and price 0 here).
    verify_context_token_us: float = 0.0
    # Per decode row of a step that also carries prefill tokens: an engine that attends a mixed
    # step's decode rows one by one (a gather of each row's cache and a few kernels per row and
    # layer) pays this beside what the step's token count and KV read already price.
    mixed_decode_row_us: float = 0.0
    # Per verify row of a step that also carries prefill tokens, beside mixed_decode_row_us: a
    # verify row there is 1 + k query tokens attended beside a prompt's chunk, which neither
    # the pure verify steps (verify_context_token_us) nor a mixed step's one-token decode rows
    # price. 0 (absent) prices such a row as any decode row of a mixed step.
    mixed_verify_row_us: float = 0.0
    # The token counts of the engine's prefill graphs (the local engine's piecewise graphs),
    # ascending: a step with prefill tokens of up to the largest runs padded to the next one,
    # and its padding costs what prompt tokens cost in the graphed layers (priced at the
    # prefill per-token rate). Empty (absent): steps with prefill run unpadded.
    prefill_graph_tokens: tuple[int, ...] = ()
    # The engine schedules one step ahead (vLLM's and the local engine's async scheduling on a
    # GPU): step k+1 is planned while step k runs, so a request that arrives during step k
    # joins step k+2 at the earliest.
    async_scheduling: bool = False
    # What a request costs outside the engine's steps (`[frontend]`): from the client's send
    # until the engine has it (HTTP, parsing, the server's intake), and from the step that
    # produced a token until the client has it (the server's output path, streaming). The
    # in-process simulator's client adds them (agentab.replay.targets.engine); a server in
    # front of the simulator does not, its own HTTP path being real.
    frontend_intake_us: float = 0.0
    frontend_output_us: float = 0.0

    def table(self, path: str) -> DecodeTable:
        return self.specialized if path == "specialized" else self.standard

    def capacity_blocks(self, block_size: int) -> int:
        """KV capacity in blocks of `block_size` tokens (the profile states it at its own size)."""
        return self.kv_capacity_blocks * self.kv_block_size_tokens // block_size

    def kv_read_us_per_context_token(self) -> float:
        """Microseconds per step for each context token attended by a decode row (all layers)."""
        return self.kv_layers * self.kv_bytes_per_token_per_layer / self.hbm_read_bytes_per_s * 1e6

    def identity(self) -> dict[str, Any]:
        return {
            "profile": self.name,
            "profile_hash": self.content_hash,
            "profile_status": self.status,
            "gpu_name": self.gpu_name,
            "gpu_count": self.gpu_count,
            "tp": self.tp,
            "model": self.model,
        }


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped inside the package."""
    root = resources.files("agentab.engine") / "profiles"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def load_profile(profile: str | Path) -> HardwareProfile:
    """Load a profile by builtin name or file path; bad content raises a one-line AgentabError."""
    path = Path(profile)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise AgentabError(f"{path}: profile file not found")
        data = path.read_bytes()
        source = str(path)
    else:
        res = resources.files("agentab.engine") / "profiles" / f"{profile}.toml"
        if not res.is_file():
            known = ", ".join(builtin_profiles())
            raise AgentabError(f"profile {profile!r}: no such builtin profile (known: {known})")
        data = res.read_bytes()
        source = f"builtin:{profile}"
    return parse_profile(data, source)


def parse_profile(data: bytes, source: str) -> HardwareProfile:
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise AgentabError(f"{source}: not valid TOML: {exc}") from None
    r = _Reader(doc, source)
    fmt = r.integer("format_version", 1, 1)
    del fmt
    status = r.string("status")
    if status not in STATUSES:
        raise AgentabError(f"{source}: status: must be one of {', '.join(STATUSES)}")
    num_layers = r.integer("num_layers", 1)
    kv = r.table("kv_cache")
    dec = r.table("decode")
    std = dec.table("standard")
    spec = dec.table("specialized")
    pre = r.table("prefill")
    sd = r.table("spec_decode")
    eng = r.table("engine", optional=True)
    front = r.table("frontend", optional=True)
    limits = spec.int_list("max_requests_by_q")
    if len(limits) != 8:
        raise AgentabError(
            f"{source}: decode.specialized.max_requests_by_q: needs 8 entries (q=1..8)"
        )
    profile = HardwareProfile(
        name=r.string("name"),
        status=status,
        source=source,
        content_hash=hashlib.sha256(data).hexdigest(),
        model=r.string("model"),
        gpu_name=r.string("gpu_name"),
        gpu_count=r.integer("gpu_count", 1),
        tp=r.integer("tp", 1),
        num_layers=num_layers,
        kv_layers=r.integer("kv_layers", 0, num_layers),
        kv_block_size_tokens=kv.integer("block_size_tokens", 1),
        kv_capacity_blocks=kv.integer("capacity_blocks", 1),
        kv_bytes_per_token_per_layer=kv.number("bytes_per_token_per_layer", 0.0),
        hbm_read_bytes_per_s=kv.number("hbm_read_bytes_per_s", 1.0),
        cuda_graph_max_tokens=dec.integer("cuda_graph_max_tokens", 1),
        standard=_decode_table(std),
        specialized=_decode_table(spec),
        specialized_max_padded_tokens=spec.integer("max_padded_tokens", 1),
        specialized_max_requests_by_q=tuple(limits),
        drafter_step_us=sd.number("drafter_step_us", 0.0),
        drafter_row_us=sd.number("drafter_row_us", 0.0, default=0.0),
        verify_context_token_us=sd.number("verify_context_token_us", 0.0, default=0.0),
        mixed_verify_row_us=sd.number("mixed_verify_row_us", 0.0, default=0.0),
        prefill_tokens_per_s_per_gpu=pre.number("tokens_per_s_per_gpu", 1.0),
        attention_flops_per_token_pair=pre.number("attention_flops_per_token_pair", 0.0),
        attention_flops_per_s_per_gpu=pre.number("attention_flops_per_s_per_gpu", 1.0),
        prefill_context_token_us=pre.number("context_token_us", 0.0, default=0.0),
        mixed_decode_row_us=pre.number("mixed_decode_row_us", 0.0, default=0.0),
        prefill_graph_tokens=tuple(pre.int_list("graph_tokens", ascending=True, default=[])),
        async_scheduling=eng.boolean("async_scheduling", default=False),
        frontend_intake_us=front.number("intake_us", 0.0, default=0.0),
        frontend_output_us=front.number("output_us", 0.0, default=0.0),
    )
    for sub in (r, kv, dec, std, spec, pre, sd, eng, front):
        sub.done()
    return profile


def _decode_table(r: _Reader) -> DecodeTable:
    tokens = r.float_list("batch_tokens")
    times = r.float_list("layer_time_us")
    if len(tokens) != len(times) or not tokens:
        raise AgentabError(f"{r.where('layer_time_us')}: needs one value per batch_tokens entry")
    if any(b <= a for a, b in itertools.pairwise(tokens)) or tokens[0] < 1:
        raise AgentabError(f"{r.where('batch_tokens')}: must be increasing and >= 1")
    if any(t <= 0 for t in times):
        raise AgentabError(f"{r.where('layer_time_us')}: every time must be > 0")
    return DecodeTable(
        np.array(tokens, dtype=np.float64),
        np.array(times, dtype=np.float64),
        r.number("step_fixed_us", 0.0),
    )


class _Reader:
    """Typed access to one TOML table that names the file and key in every error and rejects
    keys it was never asked for (a misspelt key must not silently fall back to nothing)."""

    def __init__(self, doc: dict[str, Any], source: str, prefix: str = "") -> None:
        self.doc = doc
        self.source = source
        self.prefix = prefix
        self.used: set[str] = set()

    def where(self, key: str) -> str:
        return f"{self.source}: {self.prefix}{key}"

    def _get(self, key: str) -> Any:
        self.used.add(key)
        if key not in self.doc:
            raise AgentabError(f"{self.where(key)}: missing")
        return self.doc[key]

    def table(self, key: str, *, optional: bool = False) -> _Reader:
        """A sub-table; `optional` ones (added after format 1 was first written) may be absent
        and then read as empty, so every key in them takes its default."""
        if optional and key not in self.doc:
            self.used.add(key)
            return _Reader({}, self.source, f"{self.prefix}{key}.")
        value = self._get(key)
        if not isinstance(value, dict):
            raise AgentabError(f"{self.where(key)}: must be a table")
        return _Reader(value, self.source, f"{self.prefix}{key}.")

    def string(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str) or not value:
            raise AgentabError(f"{self.where(key)}: must be a non-empty string")
        return value

    def integer(self, key: str, lo: int | None = None, hi: int | None = None) -> int:
        value = self._get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise AgentabError(f"{self.where(key)}: must be an integer")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise AgentabError(f"{self.where(key)}: {value} out of range [{lo}, {hi}]")
        return value

    def number(self, key: str, lo: float | None = None, default: float | None = None) -> float:
        """A number; `default` only for keys added after format 1 was first written, so
        older profiles stay valid (docs/engine.md lists which keys have one)."""
        if default is not None and key not in self.doc:
            self.used.add(key)
            return default
        value = self._get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise AgentabError(f"{self.where(key)}: must be a number")
        if not math.isfinite(value) or (lo is not None and value < lo):
            raise AgentabError(f"{self.where(key)}: {value} must be finite and >= {lo}")
        return float(value)

    def boolean(self, key: str, *, default: bool) -> bool:
        """A boolean; absent means `default` (every boolean key is optional)."""
        if key not in self.doc:
            self.used.add(key)
            return default
        value = self._get(key)
        if not isinstance(value, bool):
            raise AgentabError(f"{self.where(key)}: must be true or false")
        return value

    def float_list(self, key: str) -> list[float]:
        value = self._get(key)
        ok = isinstance(value, list) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            for v in value
        )
        if not ok:
            raise AgentabError(f"{self.where(key)}: must be a list of numbers")
        return [float(v) for v in value]

    def int_list(
        self, key: str, *, ascending: bool = False, default: list[int] | None = None
    ) -> list[int]:
        if default is not None and key not in self.doc:
            return default
        value = self._get(key)
        ok = isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
        )
        if not ok:
            raise AgentabError(f"{self.where(key)}: must be a list of integers >= 1")
        if ascending and any(b <= a for a, b in itertools.pairwise(value)):
            raise AgentabError(f"{self.where(key)}: must be strictly increasing")
        return list(value)

    def done(self) -> None:
        extra = sorted(set(self.doc) - self.used)
        if extra:
            raise AgentabError(f"{self.where(extra[0])}: unknown key")
