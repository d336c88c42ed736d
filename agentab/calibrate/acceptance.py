"""Per-position acceptance measured on a server, as the rates the local engine and the simulator
replay (`agentab acceptance`, docs/engine.md).

Why: a synthetic acceptance length says nothing about a user's own prompts and drafter, while a
what-if of speculative decoding needs exactly that. vLLM counts the draft sequences it verified
(`spec_decode_num_drafts`) and, per draft position, the drafts it accepted there
(`spec_decode_num_accepted_tokens_per_pos`); accepted at position i / drafts is p_i, the
probability that the first i + 1 drafts are all accepted. Those are the unconditional rates that
vLLM's synthetic rejection takes (`synthetic_acceptance_rates`), that the local engine's
`speculative_config` takes under the same name and that the simulator takes as
`acceptance_probs` (agentab.engine.spec_decode), so a run on a real server carries its
acceptance into a replay on either.

Two sources: a recorded run dir (or a folder of them), whose scraped counters give the
profiling phase's increase, the window the report's acceptance covers; or a live server's
/metrics, whose counters hold everything since the server started.
"""

from __future__ import annotations

import itertools
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import orjson

from agentab.analysis.summary import DRAFTS, PER_POSITION, accepted_per_position, counter_delta
from agentab.errors import AgentabError
from agentab.redact import redact_text
from agentab.replay.metrics import parse_prometheus

NO_COUNTERS = (
    "no speculative-decoding counters ({drafts} and {per_pos}); the server must run "
    "speculative decoding"
)


@dataclass(frozen=True)
class Acceptance:
    """Drafts verified and drafts accepted per position, over one window of one source."""

    source: str
    window: str  # what the counts cover, in words
    drafts: float
    accepted: tuple[float, ...]  # per draft position, position 0 (the first draft) first

    @property
    def k(self) -> int:
        """Draft tokens per verify step: one counter series per position."""
        return len(self.accepted)

    @property
    def rates(self) -> tuple[float, ...]:
        """p_i = accepted at position i / drafts (vLLM's per-position acceptance rate)."""
        return tuple(a / self.drafts for a in self.accepted)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: the target's own token plus the accepted drafts."""
        return 1.0 + sum(self.accepted) / self.drafts

    def check(self) -> Acceptance:
        """Refuse counts no rate model can hold: no drafts, more accepted than verified, or a
        position accepted more often than the one before it (a draft is accepted only after
        every draft before it was)."""
        if self.drafts <= 0:
            raise AgentabError(f"{self.source}: no drafts verified ({self.window})")
        if any(a < 0 or a > self.drafts for a in self.accepted):
            raise AgentabError(
                f"{self.source}: accepted per position {list(self.accepted)} outside "
                f"[0, {self.drafts:g} drafts]"
            )
        if any(b > a for a, b in itertools.pairwise(self.accepted)):
            raise AgentabError(
                f"{self.source}: accepted per position {list(self.accepted)} rises with the "
                "position; per-position counts of one server never do"
            )
        return self


def from_runs(path: Path) -> Acceptance:
    """The profiling phases of the run dirs at `path` (one run dir, or a folder of them, as
    `report` takes), pooled: the same window and the same counters as the report's
    acceptance line."""
    from agentab.analysis.load import load_runs
    from agentab.analysis.summary import summarize_run

    drafts = 0.0
    accepted: list[float] | None = None
    runs = load_runs(path)
    for run in runs:
        start = summarize_run(run).values["phase_start_s"]
        metrics = run.server_metrics.collect()
        run_drafts = counter_delta(metrics, DRAFTS, start)
        run_accepted = accepted_per_position(metrics, start)
        if run_drafts is None or run_accepted is None:
            raise AgentabError(
                f"{run.path}: "
                + NO_COUNTERS.format(drafts=DRAFTS, per_pos=PER_POSITION)
                + ", and the run must scrape them ([replay] scrape_metrics = true)"
            )
        if accepted is None:
            accepted = [0.0] * len(run_accepted)
        if len(run_accepted) != len(accepted):
            raise AgentabError(
                f"{run.path}: {len(run_accepted)} draft positions, the runs before it "
                f"{len(accepted)}; pool only runs of one speculative config"
            )
        drafts += run_drafts
        accepted = [a + b for a, b in zip(accepted, run_accepted, strict=True)]
    assert accepted is not None  # load_runs returns at least one run
    window = "profiling phase" + (f" of {len(runs)} runs" if len(runs) > 1 else "")
    return Acceptance(str(path), window, drafts, tuple(accepted)).check()


def metrics_url(url: str) -> str:
    """A server's /metrics address: its base URL (`http://host:8000`, `.../v1`) or the
    /metrics address itself."""
    base = url.rstrip("/")
    if base.endswith("/metrics"):
        return base
    return base.removesuffix("/v1") + "/metrics"


def from_url(url: str, timeout_s: float = 10.0) -> Acceptance:
    """A live server's counters, cumulative since it started (summed over the labels that are
    not the position: engine cores, model names)."""
    address = metrics_url(url)
    shown = redact_text(address)
    if not address.startswith(("http://", "https://")):
        raise AgentabError(f"--url {shown}: expected an http:// or https:// server address")
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise AgentabError(f"--url {shown}: cannot read /metrics ({reason})") from None
    drafts: float | None = None
    by_position: dict[int, float] = {}
    for name, labels, value in parse_prometheus(text):
        if name == DRAFTS:
            drafts = (drafts or 0.0) + value
        elif name == PER_POSITION and "position" in labels:
            position = int(labels["position"])
            by_position[position] = by_position.get(position, 0.0) + value
    if drafts is None or not by_position:
        raise AgentabError(
            f"--url {shown}: " + NO_COUNTERS.format(drafts=DRAFTS, per_pos=PER_POSITION)
        )
    accepted = tuple(by_position.get(i, 0.0) for i in range(max(by_position) + 1))
    return Acceptance(shown, "since the server started", drafts, accepted).check()


def _floats(values: tuple[float, ...]) -> str:
    # repr is the shortest text that reads back as the same float, and valid TOML
    return "[" + ", ".join(repr(float(v)) for v in values) + "]"


def to_toml(acc: Acceptance) -> str:
    """The measurement and the two tables that replay it: `[speculative_config]` (the local
    engine, vLLM's names) and `[simulator]` (the simulator's options), each as its options
    read it."""
    rates = _floats(acc.rates)
    return "\n".join(
        [
            "# Per-position speculative-decoding acceptance measured by `agentab acceptance`.",
            "",
            "[measured]",
            f"source = {orjson.dumps(acc.source).decode()}",
            f"window = {orjson.dumps(acc.window).decode()}",
            f"drafts = {acc.drafts!r}",
            f"accepted_per_position = {_floats(acc.accepted)}",
            f"mean_acceptance_length = {acc.mean_acceptance_length!r}",
            "",
            "# The local engine: `agentab serve --engine local --speculative-config THIS_FILE`,",
            "# or these keys in an experiment's [engine.speculative_config].",
            "[speculative_config]",
            f"num_speculative_tokens = {acc.k}",
            'rejection_sample_method = "synthetic"',
            f"synthetic_acceptance_rates = {rates}",
            "",
            "# The simulator: `--num-draft-tokens K --acceptance-probs THIS_FILE`, or these keys",
            "# in an experiment's [engine].",
            "[simulator]",
            f"num_draft_tokens = {acc.k}",
            f"acceptance_probs = {rates}",
            "",
        ]
    )


def summary_lines(acc: Acceptance) -> list[str]:
    """What the command prints: the counts, the mean acceptance length and the rates."""
    return [
        f"agentab acceptance: {acc.source} ({acc.window}): {acc.drafts:,.0f} drafts of "
        f"{acc.k} tokens verified",
        f"  mean acceptance length {acc.mean_acceptance_length:.3f} tokens per verify step "
        f"(1 + {sum(acc.accepted) / acc.drafts:.3f} accepted drafts)",
        "  per-position acceptance rate (accepted at position / drafts): "
        + ", ".join(f"{i + 1}: {r:.3f}" for i, r in enumerate(acc.rates)),
    ]
