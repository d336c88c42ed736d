"""The AgentX-style generator: synthetic coding-agent sessions shaped like the published traces.

What a coding agent does to a server, and how each piece is modelled:
- a per-session system + tools prefix (thousands to tens of thousands of tokens), cached by every
  turn of the session and shared by subagents of the same type;
- turns whose prompt is the previous prompt + the previous output + a new suffix (a tool result
  or a user message), so hash ids grow by suffix exactly as in AgentX traces: turn k+1's ids start
  with turn k's ids (the full blocks of its prompt) and add new ids for the rest;
- a few percent of turns reset the context (new task or compaction: the prefix survives, the
  history is replaced by a summary), and contexts that would pass the compaction threshold are
  compacted, so no prompt exceeds the cap (256k by default);
- heavy-tailed (lognormal) output lengths, tool-result sizes and pauses: short tool calls mixed
  with long edits, sub-second tool runs mixed with minutes of human think time;
- subagent fan-out: a parent turn may spawn one or more subagents that run beside it and are
  joined by the next parent turn (which waits for them), or run in the background.

Every default is in `GeneratorConfig`, with the statistic it is calibrated to; docs/workloads.md
lists them for the README. Sessions are generated independently from (seed, session index), so
the result is deterministic per seed and the first N sessions of a larger run equal a run of N.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from agentab.errors import AgentabError
from agentab.workloads.model import PARENT_AGENT_ID, Request, Session, Subagent, Workload


@dataclass(frozen=True)
class GeneratorConfig:
    """Generator parameters. Lognormal sizes are given by median and sigma (of the log)."""

    block_size: int = 64  # AgentX/Weka traces use 64-token blocks
    context_cap: int = 262144  # contexts capped at 256k tokens (the -256k corpus)
    compact_at: float = 0.9  # compaction when the next prompt would pass this fraction of the cap
    model: str = "agentx-synthetic"
    # Session prefix: system prompt + tool definitions ("thousands to tens of thousands").
    system_tokens_median: float = 2500.0
    system_tokens_sigma: float = 0.35
    tool_tokens_median: float = 5000.0
    tool_tokens_sigma: float = 0.5
    first_message_median: float = 400.0
    first_message_sigma: float = 1.0
    # Parent turns per session; with the subagents this gives ~250 requests per session
    # (the AgentX/Weka corpus: ~98.8k requests in 393 sessions).
    parent_turns_median: float = 118.0
    parent_turns_sigma: float = 0.7
    parent_turns_min: int = 4
    parent_turns_max: int = 800
    # Output tokens per request: AA-AgentPerf OSL median ~150, P95 ~2k -> sigma ln(2000/150)/1.645.
    output_median: float = 150.0
    output_sigma: float = 1.575
    output_max: int = 32768
    # New suffix per tool turn (tool results), heavy-tailed; calibrated with the reset rate so the
    # mean input is ~27k tokens (AA-AgentPerf ISL ~5k-131k, mean ~27k).
    suffix_median: float = 50.0
    suffix_sigma: float = 1.4
    suffix_max: int = 60000
    # A parent turn that starts with a human message instead of a tool result.
    human_turn_prob: float = 0.08
    human_message_median: float = 120.0
    human_message_sigma: float = 1.0
    # Context resets (new task in the same session, manual compaction): in AgentX traces about
    # 98% of turns are pure suffix growth and a few percent reset or compact the context.
    reset_prob: float = 0.02
    summary_median: float = 3000.0
    summary_sigma: float = 0.5
    # End-to-start pauses (seconds): tool execution (sub-second to tens of seconds) and human
    # think time (seconds to minutes).
    tool_pause_median_s: float = 0.8
    tool_pause_sigma: float = 1.2
    human_pause_median_s: float = 15.0
    human_pause_sigma: float = 1.4
    pause_max_s: float = 1800.0
    # Recorded server time of a request (api_time): overhead + uncached prefill + decode.
    api_overhead_s: float = 0.35
    prefill_tokens_per_s: float = 15000.0
    decode_tokens_per_s: float = 60.0
    # Subagents: spawn chance per parent tool turn, extra parallel subagents, background share.
    subagent_spawn_prob: float = 0.025
    subagent_parallel_prob: float = 0.35  # each further parallel subagent, up to the max
    subagent_parallel_max: int = 4
    subagent_background_prob: float = 0.12
    subagent_turns_median: float = 16.0
    subagent_turns_sigma: float = 0.7
    subagent_turns_max: int = 200
    subagent_system_tokens_median: float = 2000.0
    subagent_tool_tokens_median: float = 4000.0
    subagent_prefix_sigma: float = 0.4
    subagent_task_median: float = 500.0
    subagent_task_sigma: float = 1.0
    subagent_types: tuple[str, ...] = ("Explore", "general-purpose", "Plan")

    def validate(self) -> GeneratorConfig:
        """Reject values that cannot describe a workload (one line naming the parameter)."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "subagent_types":
                if not v or not all(isinstance(x, str) and x for x in v):
                    raise AgentabError("generator: 'subagent_types' must be non-empty strings")
                continue
            if isinstance(v, str):
                continue
            if not math.isfinite(v) or v < 0:
                raise AgentabError(f"generator: {f.name!r} must be a finite number >= 0 (got {v})")
            if f.name.endswith("_prob") or f.name == "compact_at":
                if v > 1:
                    raise AgentabError(f"generator: {f.name!r} is a probability (got {v})")
            elif f.name.endswith(("_median", "_median_s", "_per_s")) and v <= 0:
                raise AgentabError(f"generator: {f.name!r} must be > 0 (got {v})")
        if self.block_size < 1:
            raise AgentabError("generator: 'block_size' must be >= 1")
        if not 1 <= self.parent_turns_min <= self.parent_turns_max:
            raise AgentabError("generator: need 1 <= parent_turns_min <= parent_turns_max")
        if self.context_cap < 4 * self.block_size:
            raise AgentabError("generator: 'context_cap' is smaller than 4 blocks")
        return self


PRESETS: dict[str, GeneratorConfig] = {"agentx-coding": GeneratorConfig()}


def load_config(preset: str, toml_path: str | Path | None = None) -> GeneratorConfig:
    """A preset, with the parameters of a TOML file (top-level keys) overriding its values."""
    if preset not in PRESETS:
        raise AgentabError(f"unknown preset {preset!r} (available: {', '.join(sorted(PRESETS))})")
    config = PRESETS[preset]
    if toml_path is None:
        return config.validate()
    path = Path(toml_path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise AgentabError(f"{path}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise AgentabError(f"{path}: invalid TOML ({exc})") from None
    return apply_overrides(config, data, str(path)).validate()


def apply_overrides(config: GeneratorConfig, data: dict[str, Any], where: str) -> GeneratorConfig:
    known = {f.name: f for f in fields(GeneratorConfig)}
    defaults = asdict(config)
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise AgentabError(f"{where}: unknown generator parameter {key!r}")
        current = defaults[key]
        if isinstance(current, tuple):
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise AgentabError(f"{where}: {key!r} must be an array of strings")
            value = tuple(value)
        elif isinstance(current, bool) or isinstance(value, bool):
            raise AgentabError(f"{where}: {key!r} must be a number")
        elif isinstance(current, int) and not isinstance(current, bool):
            if not isinstance(value, int):
                raise AgentabError(f"{where}: {key!r} must be an integer (got {value!r})")
        elif isinstance(current, float):
            if not isinstance(value, int | float):
                raise AgentabError(f"{where}: {key!r} must be a number (got {value!r})")
            value = float(value)
        elif isinstance(current, str) and not isinstance(value, str):
            raise AgentabError(f"{where}: {key!r} must be a string (got {value!r})")
        changes[key] = value
    return replace(config, **changes)


# ------------------------------------------------------------------------------------ generation


class _Ids:
    """Hash ids of one session tree: local scope, unique within the session, from 1 up."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> tuple[int, ...]:
        if n <= 0:
            return ()
        start = self.next
        self.next += n
        return tuple(range(start, start + n))


def _lognormal(rng: np.random.Generator, median: float, sigma: float, size: int) -> np.ndarray:
    return rng.lognormal(math.log(median), sigma, size)


def _ms(x: float) -> float:
    """Times are recorded in milliseconds (AgentX's duration_ms), so exports round-trip exactly."""
    return round(x, 3)


@dataclass
class _Prefix:
    tokens: int
    ids: tuple[int, ...]
    system: int
    tools: int


class _SessionGen:
    """Generates one session tree from its own random stream."""

    def __init__(self, cfg: GeneratorConfig, rng: np.random.Generator, session_id: str) -> None:
        self.cfg = cfg
        self.rng = rng
        self.session_id = session_id
        self.ids = _Ids()
        self.bs = cfg.block_size
        self.limit = max(int(cfg.context_cap * cfg.compact_at), 2 * cfg.block_size)
        self.subagent_prefixes: dict[str, _Prefix] = {}
        self.n_agents = 0

    # -- helpers -----------------------------------------------------------------------------

    def _prefix(
        self, system_median: float, system_sigma: float, tools_median: float, tools_sigma: float
    ) -> _Prefix:
        cap = self.limit // 8
        system = int(min(_lognormal(self.rng, system_median, system_sigma, 1)[0], cap))
        tools = int(min(_lognormal(self.rng, tools_median, tools_sigma, 1)[0], cap))
        system, tools = max(system, 1), max(tools, 1)
        return _Prefix(system + tools, self.ids.take((system + tools) // self.bs), system, tools)

    def _extend(self, ids: tuple[int, ...], in_tokens: int) -> tuple[int, ...]:
        need = in_tokens // self.bs
        return ids + self.ids.take(need - len(ids)) if need > len(ids) else ids

    def _api_time(self, in_tokens: int, cached_blocks: int, out: int) -> tuple[float, float]:
        cfg = self.cfg
        uncached = max(in_tokens - cached_blocks * self.bs, 1)
        ttft = cfg.api_overhead_s + uncached / cfg.prefill_tokens_per_s
        return _ms(ttft + out / cfg.decode_tokens_per_s), _ms(ttft)

    def _outputs(self, n: int) -> np.ndarray:
        cfg = self.cfg
        out = _lognormal(self.rng, cfg.output_median, cfg.output_sigma, n)
        return np.clip(np.rint(out), 1, cfg.output_max).astype(np.int64)

    def _suffixes(self, n: int) -> np.ndarray:
        cfg = self.cfg
        s = _lognormal(self.rng, cfg.suffix_median, cfg.suffix_sigma, n)
        return np.clip(np.rint(s), 1, cfg.suffix_max).astype(np.int64)

    def _pauses(self, n: int, median: float, sigma: float) -> np.ndarray:
        p = _lognormal(self.rng, median, sigma, n)
        return np.minimum(p, self.cfg.pause_max_s)

    # -- the parent ---------------------------------------------------------------------------

    def session(self) -> Session:
        cfg, rng = self.cfg, self.rng
        prefix = self._prefix(
            cfg.system_tokens_median,
            cfg.system_tokens_sigma,
            cfg.tool_tokens_median,
            cfg.tool_tokens_sigma,
        )
        n = int(
            np.clip(
                round(
                    float(_lognormal(rng, cfg.parent_turns_median, cfg.parent_turns_sigma, 1)[0])
                ),
                cfg.parent_turns_min,
                cfg.parent_turns_max,
            )
        )
        outs = self._outputs(n).tolist()
        suffixes = self._suffixes(n).tolist()
        human = (rng.random(n) < cfg.human_turn_prob).tolist()
        human[0] = True
        reset = (rng.random(n) < cfg.reset_prob).tolist()
        reset[0] = False
        human_msgs = (
            np.rint(_lognormal(rng, cfg.human_message_median, cfg.human_message_sigma, n))
            .astype(np.int64)
            .tolist()
        )
        summaries = (
            np.rint(_lognormal(rng, cfg.summary_median, cfg.summary_sigma, n))
            .astype(np.int64)
            .tolist()
        )
        tool_pauses = self._pauses(n, cfg.tool_pause_median_s, cfg.tool_pause_sigma).tolist()
        human_pauses = self._pauses(n, cfg.human_pause_median_s, cfg.human_pause_sigma).tolist()
        spawn = (rng.random(n) < cfg.subagent_spawn_prob).tolist()
        first = max(
            int(_lognormal(rng, cfg.first_message_median, cfg.first_message_sigma, 1)[0]), 1
        )

        items: list[Request | Subagent] = []
        in_tokens = min(prefix.tokens + first, self.limit)
        ids = self._extend(prefix.ids, in_tokens)
        cached = 0  # blocks of this prompt already sent by the previous turn
        t = 0.0
        pause_before: float | None = None
        for k in range(n):
            last = k == n - 1
            next_human = not last and human[k + 1]
            out = max(1, min(outs[k], cfg.context_cap - in_tokens))
            api, ttft = self._api_time(in_tokens, cached, out)
            tool_call = not last and not next_human
            items.append(
                Request(
                    t=t,
                    in_tokens=in_tokens,
                    out_tokens=out,
                    hash_ids=ids,
                    kind="parent",
                    agent_id=PARENT_AGENT_ID,
                    type="s",
                    input_types=("text",) if human[k] else ("tool_result",),
                    output_types=("thinking", "tool_use") if tool_call else ("thinking", "text"),
                    stop="tool_use" if tool_call else "end_turn",
                    api_time=api,
                    think_time=pause_before,
                    ttft=ttft,
                    model=cfg.model,
                )
            )
            if last:
                break
            end = t + api
            # Subagents spawned by this tool call; the next turn waits for the foreground ones.
            join_at = end
            joined_tokens = 0
            if tool_call and spawn[k]:
                for sub in self._spawn_group(end):
                    items.append(sub)
                    if sub.duration_s is not None:
                        join_at = max(join_at, sub.t + sub.duration_s)
                        joined_tokens += sub_result_tokens(sub)
            pause = human_pauses[k] if next_human else tool_pauses[k]
            t_next = _ms(max(end + pause, join_at + min(pause, 1.0)))
            pause_before = _ms(max(t_next - end, 0.0))
            # The next prompt: this prompt + this output + the new suffix, unless reset/compacted.
            grow = out + (human_msgs[k + 1] if next_human else suffixes[k]) + joined_tokens
            if reset[k + 1] or in_tokens + grow > self.limit:
                in_tokens = min(prefix.tokens + max(summaries[k], 1), self.limit)
                ids = self._extend(prefix.ids, in_tokens)
                cached = len(prefix.ids)
            else:
                cached = len(ids)
                in_tokens += grow
                ids = self._extend(ids, in_tokens)
            t = t_next
        return Session(
            id=self.session_id,
            block_size=self.bs,
            items=tuple(items),
            system_tokens=prefix.system,
            tool_tokens=prefix.tools,
            models=(cfg.model,),
        )

    # -- subagents ------------------------------------------------------------------------------

    def _spawn_group(self, at: float) -> list[Subagent]:
        cfg, rng = self.cfg, self.rng
        count = 1
        while count < cfg.subagent_parallel_max and rng.random() < cfg.subagent_parallel_prob:
            count += 1
        return [self._subagent(_ms(at + 0.05 * (i + 1))) for i in range(count)]

    def _subagent(self, spawn: float) -> Subagent:
        cfg, rng = self.cfg, self.rng
        self.n_agents += 1
        agent_id = f"agent_{self.n_agents:03d}"
        sub_type = cfg.subagent_types[int(rng.integers(len(cfg.subagent_types)))]
        prefix = self.subagent_prefixes.get(sub_type)
        if prefix is None:  # subagents of one type share their system + tools prefix
            prefix = self._prefix(
                cfg.subagent_system_tokens_median,
                cfg.subagent_prefix_sigma,
                cfg.subagent_tool_tokens_median,
                cfg.subagent_prefix_sigma,
            )
            self.subagent_prefixes[sub_type] = prefix
        background = bool(rng.random() < cfg.subagent_background_prob)
        n = int(
            np.clip(
                round(
                    float(
                        _lognormal(rng, cfg.subagent_turns_median, cfg.subagent_turns_sigma, 1)[0]
                    )
                ),
                1,
                cfg.subagent_turns_max,
            )
        )
        outs = self._outputs(n).tolist()
        suffixes = self._suffixes(n).tolist()
        pauses = self._pauses(n, cfg.tool_pause_median_s, cfg.tool_pause_sigma).tolist()
        task = max(int(_lognormal(rng, cfg.subagent_task_median, cfg.subagent_task_sigma, 1)[0]), 1)
        in_tokens = min(prefix.tokens + task, self.limit)
        ids = self._extend(prefix.ids, in_tokens)
        cached = len(prefix.ids)
        t = _ms(spawn + 0.05)
        requests: list[Request] = []
        total = 0
        tool_uses = 0
        pause_before: float | None = None
        end = t
        for k in range(n):
            last = k == n - 1
            out = max(1, min(outs[k], cfg.context_cap - in_tokens))
            api, ttft = self._api_time(in_tokens, cached, out)
            requests.append(
                Request(
                    t=t,
                    in_tokens=in_tokens,
                    out_tokens=out,
                    hash_ids=ids,
                    kind="subagent",
                    agent_id=agent_id,
                    type="s",
                    input_types=("text",) if k == 0 else ("tool_result",),
                    output_types=("thinking", "text") if last else ("thinking", "tool_use"),
                    stop="end_turn" if last else "tool_use",
                    api_time=api,
                    think_time=pause_before,
                    ttft=ttft,
                    model=cfg.model,
                )
            )
            total += in_tokens + out
            tool_uses += 0 if last else 1
            end = t + api
            if last:
                break
            t_next = _ms(end + pauses[k])
            pause_before = _ms(max(t_next - end, 0.0))
            grow = out + suffixes[k]
            if in_tokens + grow > self.limit:
                in_tokens = min(prefix.tokens + task, self.limit)
                ids = self._extend(prefix.ids, in_tokens)
                cached = len(prefix.ids)
            else:
                cached = len(ids)
                in_tokens += grow
                ids = self._extend(ids, in_tokens)
            t = t_next
        duration_ms = math.ceil((end - spawn) * 1000.0 + 20.0)
        return Subagent(
            agent_id=agent_id,
            t=spawn,
            duration_s=None if background else duration_ms / 1000.0,
            items=tuple(requests),
            subagent_type=sub_type,
            status="async_launched" if background else "completed",
            system_tokens=prefix.system,
            tool_tokens=prefix.tools,
            total_tokens=None if background else total,
            tool_use_count=None if background else tool_uses,
            models=(cfg.model,),
        )


def sub_result_tokens(sub: Subagent) -> int:
    """What a joined subagent hands back to its parent: its final answer."""
    last = None
    for r in sub.requests():
        last = r
    return 0 if last is None else last.out_tokens


MAX_SESSIONS = 10_000
"""Most sessions one generated workload may hold: each default session holds about 250
requests and takes about 1 MB in memory (measured: 1,000 sessions, 0.98 GB, 3 s), so the bound
keeps a typo from growing a process without limit. The AgentX/Weka corpus has 393 sessions."""


def generate(config: GeneratorConfig, sessions: int, seed: int) -> Workload:
    """`sessions` sessions; session i depends only on (seed, i)."""
    if sessions < 1:
        raise AgentabError(f"--sessions must be >= 1 (got {sessions})")
    if sessions > MAX_SESSIONS:
        raise AgentabError(
            f"--sessions must be <= {MAX_SESSIONS:,} (got {sessions:,}; about 1 MB per session)"
        )
    if seed < 0:
        raise AgentabError(f"--seed must be >= 0 (got {seed})")
    config.validate()
    out = []
    for i in range(sessions):
        rng = np.random.default_rng([seed, i])
        out.append(_SessionGen(config, rng, f"agentx-{seed}-{i:05d}").session())
    return Workload(tuple(out), source=f"generated:agentx-coding:seed={seed}")
