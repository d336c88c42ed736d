"""Replay options: everything that decides what is sent and when, in one frozen value.

One value is shared by the CLI, `simulate_to_dir`, `replay_to_dir` and the A/B orchestration, and
is written verbatim into each run's manifest (`replay` key), so two runs with equal options and
the same workload send identical requests at identical planned times.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from agentab.errors import AgentabError

Endpoint = Literal["completions", "chat"]
ENDPOINTS: tuple[str, ...] = ("completions", "chat")


@dataclass(frozen=True)
class ReplayOptions:
    """How to replay a workload.

    Closed loop (default): `concurrency` lanes each hold one session tree until it drains.
    Open loop: `rate` (Poisson session arrivals per second) or `time_scale` (recorded session
    arrival offsets multiplied by this factor; 0.5 replays arrivals twice as fast).
    `duration_s` is the profiling window: it opens when the last warmup request has finished.
    `None` for `duration_s`, `max_requests`, `lane_requests` and `passes` means "no limit from
    this rule". `lane_requests` ends each lane after that many profiling requests: two runs of
    one plan then send the same requests whatever their speeds (docs/replay.md).
    Idle caps of 0 disable that compression rule. `drain_s` caps the drain: requests still in
    flight that long after the window closed are cut (recorded as cancelled, in no metric);
    None caps it at the window's own length, so a run never lasts more than twice its window.
    The manifest records the cut (docs/replay.md).
    `max_behind_plan_ms`: analysis refuses the run when a replay client sent its requests later
    than this after their planned times at P90 (agentab.replay.client_load); a host whose server
    shares the client's cores may need more.
    `prompt_salt` enters every play's salt: None draws a fresh one for each run (so a rerun
    against a warm server does not find its prompts in the prefix cache), and the manifest
    records the one used, so giving it back reproduces that run's exact prompts.
    """

    concurrency: int = 1
    rate: float | None = None
    time_scale: float | None = None
    duration_s: float | None = 3600.0
    max_requests: int | None = None
    lane_requests: int | None = None
    start_window: tuple[float, float] = (0.25, 0.75)
    warmup_requests: int = 10
    idle_cap_global_s: float = 10.0
    idle_cap_tree_s: float = 300.0
    seed: int = 42
    passes: int | None = None
    max_error_rate: float = 0.10
    endpoint: Endpoint = "completions"
    request_timeout_s: float = 600.0
    scrape_metrics: bool = False
    scrape_interval_s: float = 1.0
    prompt_salt: str | None = None
    drain_s: float | None = None
    max_behind_plan_ms: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_window", tuple(float(x) for x in self.start_window))
        _check(
            isinstance(self.concurrency, int) and 1 <= self.concurrency <= MAX_CONCURRENCY,
            "concurrency",
            f"an integer from 1 to {MAX_CONCURRENCY:,} (lanes, each a live session tree)",
        )
        _check(self.rate is None or _finite_pos(self.rate), "rate", "> 0")
        _check(self.time_scale is None or _finite_pos(self.time_scale), "time_scale", "> 0")
        _check(
            self.rate is None or self.time_scale is None,
            "rate",
            "not combined with time_scale (choose one open-loop mode)",
        )
        _check(self.duration_s is None or _finite_pos(self.duration_s), "duration_s", "> 0")
        _check(_opt_int_pos(self.max_requests), "max_requests", "an integer >= 1")
        _check(_opt_int_pos(self.lane_requests), "lane_requests", "an integer >= 1")
        _check(
            self.lane_requests is None or not self.open_loop,
            "lane_requests",
            "used with closed-loop lanes (concurrency), not rate or time_scale",
        )
        _check(_opt_int_pos(self.passes), "passes", "an integer >= 1")
        lo, hi = self.start_window if len(self.start_window) == 2 else (-1.0, -1.0)
        _check(0.0 <= lo <= hi <= 1.0, "start_window", "two fractions 0 <= LO <= HI <= 1")
        _check(
            isinstance(self.warmup_requests, int) and self.warmup_requests >= 0,
            "warmup_requests",
            "an integer >= 0",
        )
        _check(_finite_nonneg(self.idle_cap_global_s), "idle_cap_global_s", ">= 0")
        _check(_finite_nonneg(self.idle_cap_tree_s), "idle_cap_tree_s", ">= 0")
        _check(isinstance(self.seed, int), "seed", "an integer")
        _check(0.0 <= self.max_error_rate <= 1.0, "max_error_rate", "between 0 and 1")
        _check(self.endpoint in ENDPOINTS, "endpoint", f"one of {', '.join(ENDPOINTS)}")
        _check(_finite_pos(self.request_timeout_s), "request_timeout_s", "> 0")
        _check(_finite_pos(self.scrape_interval_s), "scrape_interval_s", "> 0")
        _check(self.drain_s is None or _finite_pos(self.drain_s), "drain_s", "> 0")
        _check(_finite_pos(self.max_behind_plan_ms), "max_behind_plan_ms", "> 0")
        _check(
            self.prompt_salt is None or _salt_text(self.prompt_salt),
            "prompt_salt",
            f"1 to {MAX_PROMPT_SALT_CHARS} printable characters",
        )

    @property
    def open_loop(self) -> bool:
        return self.rate is not None or self.time_scale is not None

    @property
    def drain_cap_s(self) -> float | None:
        """How long requests in flight at the window's end may take to finish (None: no cap,
        when there is no window)."""
        if self.duration_s is None:
            return None
        return self.drain_s if self.drain_s is not None else self.duration_s

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the manifest's `replay` key); `from_mapping` reads it back."""
        out = asdict(self)
        out["start_window"] = list(self.start_window)
        return out

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], *, where: str = "replay options"
    ) -> ReplayOptions:
        """Build from a dict (an experiment file, a manifest); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AgentabError(
                f"{where}: unknown replay option(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        kwargs = dict(data)
        if "start_window" in kwargs:
            sw = kwargs["start_window"]
            if not isinstance(sw, (list, tuple)) or len(sw) != 2:
                raise AgentabError(f"{where}: start_window must be a pair [LO, HI], got {sw!r}")
            kwargs["start_window"] = tuple(sw)
        try:
            return cls(**kwargs)
        except AgentabError as exc:
            raise AgentabError(f"{where}: {exc}") from None
        except TypeError as exc:  # wrong value types reaching comparisons
            raise AgentabError(f"{where}: {exc}") from None


MAX_PROMPT_SALT_CHARS = 128
MAX_CONCURRENCY = 100_000
"""More lanes than any deployment serves sessions at once; a typo past it (1e8) would spend
minutes building a plan before the first request."""


def new_prompt_salt() -> str:
    """A fresh per-run prompt salt: 64 random bits in hex, as a run id would be."""
    return secrets.token_hex(8)


def _salt_text(x: object) -> bool:
    return isinstance(x, str) and 1 <= len(x) <= MAX_PROMPT_SALT_CHARS and x.isprintable()


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise AgentabError(f"replay option {name} must be {what}")


def _finite_pos(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _finite_nonneg(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _opt_int_pos(x: object) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 1)
