"""A/A: the same arm against itself with different seeds must not look significant.

Real simulator runs (agentab.replay.simulate_to_dir on the gb300-tp16-kimi-k3 profile), so
the noise is the real thing: different lane start points, different co-scheduled sessions,
different spec-decode acceptance draws.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentab.analysis.compare import compare_runs
from agentab.analysis.load import load_run
from agentab.analysis.markdown import comparison_markdown
from agentab.replay import simulate_to_dir
from agentab.replay.options import ReplayOptions
from agentab.workloads.generator import generate, load_config

ENGINE = {
    "profile": "gb300-tp16-kimi-k3",
    "decode_backend": "auto",
    "num_draft_tokens": 7,
    "acceptance_probs": [0.9, 0.82, 0.74, 0.66, 0.58, 0.5, 0.42],
}

pytestmark = pytest.mark.slow


def simulate(root: Path, workload, seed: int, concurrency: int, duration_s: float) -> Path:
    replay = ReplayOptions(
        concurrency=concurrency, duration_s=duration_s, warmup_requests=2, seed=seed
    )
    return simulate_to_dir(
        workload,
        engine_options={**ENGINE, "seed": seed},
        replay=replay,
        out_dir=root / f"seed-{seed}",
        manifest_extra={"arm": "auto"},
        progress=False,
    )


def test_aa_single_runs_get_no_verdict(tmp_path: Path) -> None:
    # Two single runs of one arm with replay seeds 1 and 2 at concurrency 8: the session
    # bootstrap alone called this pair "better" (ratio 1.074, CI 1.006-1.140). With one run per
    # arm nothing measures run-to-run noise, so no metric gets a verdict, and the report says why.
    workload = generate(load_config("agentx-coding"), 60, 42)
    a = simulate(tmp_path, workload, 1, concurrency=8, duration_s=900.0)
    b = simulate(tmp_path, workload, 2, concurrency=8, duration_s=900.0)
    result = compare_runs([load_run(a)], [load_run(b)], seed=0)
    headline = result.metrics["p90_interactivity_tok_s"]
    assert result.repeat_pairing == "none"
    assert headline.ci_sessions is not None and headline.ci_repeats is None
    assert {r.verdict for r in result.metrics.values()} <= {"no verdict", "n/a"}
    assert headline.verdict == "no verdict"
    # Long sessions: in 900 s, 8 lanes play only 13 and 17 of the 60 sessions.
    assert (result.size_a.sessions, result.size_b.sessions) == (13, 17)
    assert result.withheld == [
        "fewer than 2 runs per arm (A 1, B 1): a single run cannot show run-to-run noise, which "
        "the session bootstrap misses; use repeats >= 3"
    ]
    assert result.differences == []  # seeds differ by design and are not a guard failure
    # Separate runs draw their own prompt salts; both are shown, neither refuses.
    assert [d.field for d in result.notes] == [
        "seed",
        "replay.seed",
        "replay.prompt_salt",
        "engine_seed",
    ]
    md = comparison_markdown(result)
    assert "**no verdict**: fewer than 2 runs per arm (A 1, B 1)" in md


def test_aa_repeats_at_concurrency(tmp_path: Path) -> None:
    # Three runs per side at concurrency 4: the run-level t interval widens the CI to cover the
    # run-to-run noise that the session bootstrap alone cannot see.
    workload = generate(load_config("agentx-coding"), 60, 7)
    a = [simulate(tmp_path, workload, s, concurrency=4, duration_s=600.0) for s in (11, 12, 13)]
    b = [simulate(tmp_path, workload, s, concurrency=4, duration_s=600.0) for s in (14, 15, 16)]
    result = compare_runs([load_run(p) for p in a], [load_run(p) for p in b], seed=0)
    headline = result.metrics["p90_interactivity_tok_s"]
    assert result.repeat_pairing == "welch"
    assert headline.ci_repeats is not None
    assert (
        headline.ci_low <= headline.ci_sessions[0] and headline.ci_high >= headline.ci_sessions[1]
    )
    assert headline.ci_low < 1.0 < headline.ci_high
    assert result.withheld == [], (result.size_a, result.size_b)
    assert headline.verdict == "no significant difference"
